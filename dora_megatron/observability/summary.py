"""The run summary of DESIGN section 11 and the one record of a trained step, built by one pure function.

WHY here and pure: the simulator, ``dora train`` and ``dora bench`` must report the same fields
with the same definitions (DESIGN section 9), so the arithmetic lives in one function
(:func:`build_summary`) that takes the steps' records and the driver's counts and returns a
JSON-ready dict, and a step is one record (:class:`StepRecord`) whatever drove it. It imports
nothing heavy.

Every metric's definition is written once, in :data:`dora_megatron.observability.recorder.METRICS`;
this module is the arithmetic of the run-level ones. The drivers do not call it directly: they
feed events to :class:`~dora_megatron.observability.recorder.MetricsRecorder`, which measures
the instance-seconds, weight-load seconds and busy slot-seconds of each step into its record and
calls it. ``dora train`` adds the facts only its runtime knows (``controller/summary.py``) and
writes the file with :func:`write_summary`.

Rate metrics are computed over a *measurement window*: the steps with index >= ``warmup_steps``
(the paper averages steps after warm-up). The window's wall time runs from the end of the last
warm-up step (or time 0) to the end of the last step. Counting fields (dispatched, consumed, lost,
duplicated, violations, histogram, migrations, migrated KV bytes, re-prefilled tokens) always cover
the whole run, and both drivers take them from the same place (:meth:`RunTotals.of_orchestrator`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dora_megatron.observability.routing import routing_summary
from dora_megatron.observability.trainer_perf import trainer_perf_summary
from dora_megatron.observability.trajectories import TrajectoryTotals

#: Every key ``summary.json`` must carry (DESIGN section 11), in order.
SUMMARY_FIELDS: tuple[str, ...] = (
    "mode", "max_staleness", "tbs", "rbs", "steps", "dispatched_groups", "consumed_groups", "lost_groups",
    "duplicated_groups", "c1_violations", "c3_violations", "max_consumed_staleness", "staleness_histogram",
    "throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "rollout_utilization",
    "weight_sync_fraction", "rebalance_fraction", "migrations", "migrated_kv_bytes", "reprefill_tokens",
    "reward_first", "reward_last", "wall_time_s",
)

#: duration kinds the recorder integrates over step intervals (the keys of :attr:`StepRecord.seconds`)
INSTANCE, WEIGHT_SYNC, REBALANCE, BUSY_SLOT, TRAINER_SYNC = "instance", "weight_sync", "rebalance", "busy_slot", "trainer_sync"


@dataclass
class StepRecord:
    """One trained step, the same for both drivers (times in seconds since the run start). The
    recorder builds it, ``steps.jsonl`` carries it beside the step's scalars (a resumed run reads
    it back: new fields need defaults), the summary is computed from the run's records, and the
    runtime's step hook (``consumed.jsonl``, the progress line) reads it."""

    step: int
    end_s: float  # when the step (training + weight push) finished
    wait_s: float  # trainer idle waiting for the batch of this step (the rollout-only time)
    train_s: float  # training compute of this step
    tokens: int  # prompt+response tokens of the consumed groups
    staleness: list[int] = field(default_factory=list)  # t - w of each consumed group
    reward: float | None = None  # mean reward of the batch (None: no rewards, the simulator)
    metrics: dict[str, Any] = field(default_factory=dict)  # the trainer's own metrics (train/* scalars)
    seconds: dict[str, float] = field(default_factory=dict)  # duration kind -> seconds inside the step's interval
    trajectories: dict[str, Any] = field(default_factory=dict)  # TrajectoryTotals of the step's interval
    reward_errors: int | None = None  # samples whose reward function failed (None: no rewards, the simulator)
    groups: list[str] = field(default_factory=list)  # the consumed groups' ids, as the batch released them
    versions: list[int] = field(default_factory=list)  # each consumed group's version
    samples: int = 0  # samples trained

    @property
    def sync_s(self) -> float:
        """Trainer-side weight sync inside the step's interval (snapshot export, broadcasts)."""
        return self.seconds.get(TRAINER_SYNC, 0.0)


@dataclass
class RunTotals:
    """What the driver counts over the whole run (the rest of the summary comes from the step records)."""

    dispatched_groups: int
    consumed_groups: int
    lost_groups: int | None = 0
    c1_violations: int | None = 0
    c3_violations: int | None = 0
    migrations: int | None = 0
    migrated_kv_bytes: float | None = 0
    reprefill_tokens: int | None = 0

    @classmethod
    def of_orchestrator(cls, osum: Mapping[str, Any], **driver: Any) -> "RunTotals":
        """The orchestrator's counters (``Orchestrator.summary()``) under their summary names;
        ``driver``: the fields the driver counts itself (``migrated_kv_bytes``: the KV bytes its
        migrations moved over the whole run). Both drivers pass exactly these; the simulator's own
        checks are fields of its own result, not totals here."""
        keys = ("dispatched_groups", "consumed_groups", "lost_groups", "c1_violations", "c3_violations",
                "migrations", "reprefill_tokens")
        return cls(**{**{k: osum[k] for k in keys}, **driver})


def duplicated_groups(groups_per_step: Iterable[Sequence[str]]) -> int:
    """Groups trained more than once: each listing of a group by the steps after its first. The
    one count of ``duplicated_groups`` for both drivers (a resumed run's steps include those
    before its checkpoint, so a group trained before and after a crash counts)."""
    seen: set[str] = set()
    dup = 0
    for groups in groups_per_step:
        for g in groups:
            dup += g in seen
            seen.add(g)
    return dup


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def reward_window(steps: Sequence[StepRecord]) -> tuple[float | None, float | None]:
    """Mean reward over the first and the last 10% of steps (at least one step each)."""
    rewards = [s.reward for s in steps]
    if not rewards or any(r is None for r in rewards):
        known = [r for r in rewards if r is not None]
        if not known:
            return None, None
        rewards = known
    n = max(1, len(rewards) // 10)
    return _mean(rewards[:n]), _mean(rewards[-n:])


def build_summary(
    *,
    mode: str,
    max_staleness: int,
    tbs: int,
    rbs: int,
    steps: Sequence[StepRecord],
    totals: RunTotals,
    wall_time_s: float,
    warmup_steps: int = 0,
    slots_per_instance: int | None = None,
    rebalancer: bool = True,
) -> dict[str, Any]:
    """The summary: the DESIGN section 11 fields (every one present, null when not applicable),
    then the recorder's run metrics (``RUN_EXTRA_KEYS``). ``slots_per_instance``: request slots of
    one instance (the utilization's denominator); ``rebalancer``: the mode rebalances (else
    ``rebalance_fraction`` is null)."""
    steps = sorted(steps, key=lambda s: s.step)
    warm = min(warmup_steps, max(0, len(steps) - 1))
    window = list(steps[warm:])
    t0 = steps[warm - 1].end_s if warm > 0 else 0.0
    t1 = window[-1].end_s if window else wall_time_s
    span = t1 - t0
    hist: dict[int, int] = {}
    for s in steps:
        for d in s.staleness:
            hist[d] = hist.get(d, 0) + 1

    def total(kind: str) -> float:
        return sum(s.seconds.get(kind, 0.0) for s in window)

    def frac(x: float | None) -> float | None:
        return None if x is None or span <= 0 else x / span

    # every window step, the first one included, from the end of the step before it (the last
    # warm-up step, or time 0): the window's mean step time is then span / steps, as throughput's
    ends = [t0] + [s.end_s for s in window]
    step_times = [b - a for a, b in zip(ends, ends[1:])]
    instance_s = total(INSTANCE)

    def per_instance_s(x: float | None) -> float | None:
        return None if x is None or not instance_s else x / instance_s

    util = per_instance_s(total(BUSY_SLOT) / slots_per_instance) if slots_per_instance else None
    reward_first, reward_last = reward_window(steps)
    out: dict[str, Any] = {
        "mode": mode,
        "max_staleness": max_staleness,
        "tbs": tbs,
        "rbs": rbs,
        "steps": len(steps),
        "dispatched_groups": totals.dispatched_groups,
        "consumed_groups": totals.consumed_groups,
        "lost_groups": totals.lost_groups,
        "duplicated_groups": duplicated_groups(s.groups for s in steps),
        "c1_violations": totals.c1_violations,
        "c3_violations": totals.c3_violations,
        "max_consumed_staleness": max(hist) if hist else None,
        "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
        "throughput_tokens_per_s": (sum(s.tokens for s in window) / span) if span > 0 and window else None,
        "mean_step_time_s": _mean(step_times),
        "rollout_only_fraction": frac(sum(s.wait_s for s in window)) if window else None,
        "rollout_utilization": util,
        "weight_sync_fraction": per_instance_s(total(WEIGHT_SYNC)),
        "rebalance_fraction": per_instance_s(total(REBALANCE)) if rebalancer else None,
        "migrations": totals.migrations,
        "migrated_kv_bytes": totals.migrated_kv_bytes,
        "reprefill_tokens": totals.reprefill_tokens,
        "reward_first": reward_first,
        "reward_last": reward_last,
        "wall_time_s": wall_time_s,
    }
    out["trainer_sync_fraction"] = frac(total(TRAINER_SYNC)) if window else None
    diffs = [s.metrics["rollout_vs_trainer_logprob_diff"] for s in steps
             if s.metrics.get("rollout_vs_trainer_logprob_diff") is not None]
    # measured on on-policy samples only (see algo.losses.policy_loss): engine vs trainer numerics
    out["rollout_vs_trainer_logprob_diff_mean"] = sum(diffs) / len(diffs) if diffs else None
    out["rollout_vs_trainer_logprob_diff_max"] = max(diffs) if diffs else None
    out["rollout_vs_trainer_logprob_diff_steps"] = len(diffs)
    out.update(routing_summary(s.metrics for s in steps))
    errors = [s.reward_errors for s in steps if s.reward_errors is not None]
    out["reward_errors"] = sum(errors) if errors else None
    out.update(trainer_perf_summary((s.metrics for s in steps), (s.metrics for s in window)))
    traj = TrajectoryTotals.total(s.trajectories for s in steps).scalars()
    out["turns_per_trajectory_mean"] = traj["turns_per_trajectory"]
    out["tokens_per_turn_mean"] = traj["tokens_per_turn"]
    out["tool_latency_s_mean"] = traj["tool_latency_s"]
    out["tool_use_rate"] = traj["tool_use_rate"]
    return out


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    """``RUN_DIR/summary.json``: the one writer of the file (the controller at the end of the run,
    the launcher again once the held-out rates it adds are known)."""
    path = Path(run_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
