"""What a simulation hands back: the summary, the per-step series the plots draw (a view of the
recorder's step records, :func:`series_of`), the orchestrator's share of the run's CPU time, and the
speculation report.

WHY apart from the executor (:mod:`.engine`): these are records the run fills as it goes and reads
once at its end; none of them decides anything, so the event loop stays the one place that does.
"""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, TypeVar

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.config.sim import SimConfig
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.summary import RunTotals, StepRecord
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.sim.checks import ReleaseChecks
from dora_megatron.sim.cost import DecodeModel
from dora_megatron.sim.elastic import ElasticColocation
from dora_megatron.sim.instance import SimInstance
from dora_megatron.sim.trainer import SimStep

T = TypeVar("T")

SERIES_KEYS = ("step", "end_s", "step_time_s", "wait_s", "train_s", "weight_sync_s", "tokens", "bubble",
               "mean_staleness", "live_versions", "instances_by_version", "mean_response_tokens",
               "max_response_tokens")


@dataclass
class SimResult:
    """What one simulation produced: the DESIGN section 11 summary plus series for plots."""

    summary: dict[str, Any]
    series: dict[str, list[Any]]
    timeline: list[tuple[str, float, float, int | None, str]]
    extra: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)  # the steps.jsonl rows (same keys as dora train)

    def to_json(self) -> dict[str, Any]:
        return {**self.summary, "series": self.series, "extra": self.extra}


@dataclass(frozen=True)
class StepExtras:
    """What the plots draw of a trained step that its
    :class:`~dora_megatron.observability.summary.StepRecord` does not hold: the response lengths'
    shape (the record counts samples, not lengths), the version mix at the step's end, and the sync
    seconds as charged (the record's ``sync_s`` is the same interval integrated by the recorder,
    ``end - (end - sync_s)``, equal only up to rounding). Sim-only, so not fields of the record."""

    weight_sync_s: float  # the trainer push or role swap charged after training
    bubble: float  # (max - mean) / max response tokens of the step's samples
    mean_response_tokens: float
    max_response_tokens: int
    live_versions: int  # versions with unconsumed groups, plus the newest weights
    instances_by_version: dict[str, int]  # version (as the JSON key) -> active plus switching instances

    @classmethod
    def of(cls, trained: SimStep, live_versions: int, instances_by_version: Mapping[int, int]) -> "StepExtras":
        """The extras of the step ``trained`` at its end (``instances_by_version``: the orchestrator's)."""
        return cls(weight_sync_s=trained.sync_s, bubble=trained.bubble, mean_response_tokens=trained.mean_len,
                   max_response_tokens=trained.max_len, live_versions=live_versions,
                   instances_by_version={str(k): v for k, v in sorted(instances_by_version.items())})


def series_of(records: Sequence[StepRecord], extras: Sequence[StepExtras]) -> dict[str, list[Any]]:
    """The per-step series the plots draw (:mod:`.plots`; ``SERIES_KEYS``, one list per key): a view
    of the run's step records (``records``, the recorder's, in training order) and each step's
    :class:`StepExtras` (``extras``, same order). ``step_time_s`` is each step's end minus the one
    before it (the run start for the first)."""
    if len(records) != len(extras):
        raise ValueError(f"series_of: {len(records)} step records but {len(extras)} step extras; "
                         "one StepExtras is recorded per trained step")
    s: dict[str, list[Any]] = {k: [] for k in SERIES_KEYS}
    prev_end = 0.0
    for r, x in zip(records, extras):
        s["step"].append(r.step)
        s["end_s"].append(r.end_s)
        s["step_time_s"].append(r.end_s - prev_end)
        s["wait_s"].append(r.wait_s)
        s["train_s"].append(r.train_s)
        s["weight_sync_s"].append(x.weight_sync_s)
        s["tokens"].append(r.tokens)
        s["bubble"].append(x.bubble)
        st = r.staleness
        s["mean_staleness"].append(sum(st) / len(st) if st else None)
        s["live_versions"].append(x.live_versions)
        s["instances_by_version"].append(dict(x.instances_by_version))
        s["mean_response_tokens"].append(x.mean_response_tokens)
        s["max_response_tokens"].append(x.max_response_tokens)
        prev_end = r.end_s
    return s


@dataclass
class OrchestratorProfile:
    """The orchestrator's share of the run: its calls and their wall time (the simulator's
    profiler; the decisions themselves are timed, not the simulated effects)."""

    calls: int = 0
    wall_s: float = 0.0
    rebalance_wall_s: float = 0.0
    max_call_s: float = 0.0

    def timed(self, call: Callable[[], T], rebalances: Callable[[], int]) -> tuple[T, int]:
        """``call()`` timed; also the number of rebalances it ran (``rebalances``: the counter)."""
        before = rebalances()
        t = _time.perf_counter()
        out = call()
        dt = _time.perf_counter() - t
        self.calls += 1
        self.wall_s += dt
        self.max_call_s = max(self.max_call_s, dt)
        n = rebalances() - before
        if n:
            self.rebalance_wall_s += dt
        return out, n


def speculation_report(model: DecodeModel, cfg: SimConfig, instances: Iterable[SimInstance]) -> dict[str, Any]:
    """What speculation did in a run: the model's tokens per verify step and the share of decoded
    tokens that came from verify steps (the rest were decoded at batches where the policy does not draft)."""
    insts = list(instances)
    decoded = sum(i.decoded_tokens for i in insts)
    spec = sum(i.spec_tokens for i in insts)
    out: dict[str, Any] = {"mode": cfg.rollout.speculative, "spec_tokens": cfg.rollout.spec_tokens,
                           "spec_max_batch": cfg.rollout.spec_max_batch,
                           "decoded_tokens": decoded, "speculative_tokens": spec,
                           "speculative_token_share": spec / decoded if decoded else 0.0}
    if model.spec is not None:
        out["acceptance"] = model.acceptance
        out["draft_tokens"] = model.draft_tokens  # the engine policy's draft length for a lone request
        out["tokens_per_verify_step"] = model.tokens_per_verify
        out["verify_steps_per_request_token"] = 1.0 / model.tokens_per_verify
        out["largest_speculating_batch"] = model.largest_speculating_batch
    return out


class RowSink:
    """Keeps each step's scalars (the simulator's steps.jsonl rows)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        self.rows.append({"step": step, **values})


class _Run(Protocol):
    """What the result is built from: the simulation's records at the end of its run."""

    cfg: SimConfig
    ocfg: OrchestratorConfig
    mode: str
    S: int
    placement: str
    slot_cap: int
    record_timeline: bool
    orch: Orchestrator
    metrics: MetricsRecorder
    checks: ReleaseChecks
    profile: OrchestratorProfile
    elastic: ElasticColocation
    decode_model: DecodeModel
    instances: dict[str, SimInstance]
    rollout_ids: list[str]
    window_start: float | None
    deadlock: bool
    migrations_in_window: int
    migrated_bytes: float
    elastic_kv_bytes: float
    migration_s_in_window: float
    sim_reprefill_tokens: int
    switch_s_total: float
    dual_switches: int
    step_extras: list[StepExtras]
    step_rows: list[dict[str, Any]]


def build_result(sim: _Run, end: float, cpu_s: float) -> SimResult:
    """The run's :class:`SimResult` from what ``sim`` recorded (``end``: the virtual time it stopped)."""
    cfg = sim.cfg
    oc = sim.orch.counters
    rows = sim.metrics.rows
    wall = rows[-1].end_s if rows else end
    window_start = sim.window_start if sim.window_start is not None else 0.0
    n_roll = len(sim.rollout_ids)
    span = max(1e-9, wall - window_start)
    # exactly the totals dora train passes (controller/summary.py::run_summary): the orchestrator's
    # counters, and the KV bytes the driver moved over the whole run. The simulator's independent
    # checks (it sees every request) are their own fields (extra["sim_checks"]), never folded in here,
    # so a shared field means the same count whichever driver wrote it.
    totals = RunTotals.of_orchestrator(sim.orch.summary(), migrated_kv_bytes=sim.migrated_bytes)
    summary = sim.metrics.summary(mode=sim.mode, max_staleness=sim.S, tbs=sim.ocfg.tbs,
                                  rbs=sim.orch.policy.rbs, totals=totals, wall_time_s=wall)
    n_steps = max(1, len(rows))
    series = series_of(rows, sim.step_extras)
    timeline: list[tuple[str, float, float, int | None, str]] = []
    if sim.record_timeline:
        for iid, inst in list(sim.instances.items())[: cfg.sim.timeline_max_instances]:
            timeline.extend((iid, a, b, v, st) for a, b, v, st in inst.intervals)
    prof = sim.profile
    extra = {
        "placement": sim.placement,
        "rollout_instances": n_roll,
        "elastic_instances": len(sim.elastic.ids),
        "trainer_gpus": cfg.cluster.trainer_gpu_count(sim.mode),
        "total_gpus": cfg.cluster.total_gpus,
        "deadlock": sim.deadlock,
        "virtual_time_s": end,
        "sim_cpu_s": cpu_s,
        "orchestrator_calls": prof.calls,
        "orchestrator_wall_s": prof.wall_s,
        "orchestrator_wall_s_per_step": prof.wall_s / n_steps,
        "orchestrator_rebalances": oc.rebalances,
        "orchestrator_wall_s_per_rebalance": (prof.rebalance_wall_s / oc.rebalances) if oc.rebalances else None,
        "orchestrator_max_call_s": prof.max_call_s,
        "orchestrator_summary": sim.orch.summary(),
        # what a checkpoint holds of the orchestrator: must stay O(outstanding work), not O(steps)
        "orchestrator_state_bytes": len(json.dumps(sim.orch.snapshot()).encode()),
        "switch_instance_s": sim.switch_s_total,
        # orchestrator.dual_version: switches that kept the old version's tail, and the
        # instance-seconds a second weight set was held (its memory, counted)
        "dual_switches": sim.dual_switches,
        "dual_weight_instance_s": sum(i.dual_s + ((end - i.tail_since) if i.tail_version is not None else 0.0)
                                      for i in sim.instances.values()),
        # the window's moves and their transfer time (the summary's migrations: the orchestrator's, whole run)
        "migrations_in_window": sim.migrations_in_window,
        "migration_fraction": sim.migration_s_in_window / (max(1, n_roll) * sim.slot_cap * span),
        "elastic_kv_bytes": sim.elastic_kv_bytes,
        "sim_reprefill_tokens": sim.sim_reprefill_tokens,
        "slot_cap": sim.slot_cap,
        # the simulator's own check of every released batch (sim/checks.py), independent of the
        # orchestrator's lost_groups / c3_violations in the summary
        "sim_checks": {"lost_groups": sim.checks.lost, "c3_violations": sim.checks.c3},
        "mean_response_tokens": (sum(series["mean_response_tokens"]) / n_steps) if rows else None,
        "speculation": speculation_report(sim.decode_model, cfg, sim.instances.values()),
    }
    return SimResult(summary=summary, series=series, timeline=timeline, extra=extra, steps=sim.step_rows)
