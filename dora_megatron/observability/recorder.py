"""One metrics recorder for ``dora train`` and ``dora simulate``: events in; ``summary.json``,
``steps.jsonl`` rows and TensorBoard scalars out.

WHY one recorder fed by events: each driver (the asyncio runtime, the simulator) only reports what
happened and when -- an instance joined or left the pool, started or finished loading weights, a
request held a slot, the trainer exported or broadcast weights, a step was trained -- and every
metric is computed here from those events. Both drivers therefore report the same keys with the
same meaning, and :data:`METRICS` below is the only place a metric is defined.

Time attribution: times are seconds since the run started (a resumed run continues the clock of
its checkpoint). Step ``k``'s *interval* runs from the end of step ``k-1`` (0 for the first step)
to its own end. Every duration (instance-seconds in the pool, weight-load seconds, busy
request-slot seconds, trainer sync seconds) is split over the step intervals it overlaps, so the
per-step values add up to the run's totals, and the run-level fractions sum the steps of the
measurement window (steps with index >= ``warmup_steps``; see :mod:`.summary`). A span still open
at a step's end (an instance loading weights while the step ends) counts up to that end in that
step and continues in the next.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Mapping, Sequence

from dora_megatron.observability.summary import (
    BUSY_SLOT, INSTANCE, REBALANCE, SUMMARY_FIELDS, TRAINER_SYNC, WEIGHT_SYNC, RunTotals, StepRecord, build_summary,
)
from dora_megatron.observability.trainer_perf import TRAINER_PERF_KEYS
from dora_megatron.observability.trajectories import TrajectoryStats, TrajectoryTotals

if TYPE_CHECKING:
    from dora_megatron.observability.tensorboard import ScalarWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    key: str
    scope: str  # "run": a summary.json field; "step": one value per step (steps.jsonl and TensorBoard)
    definition: str


#: Every metric the recorder reports, with its one definition. Terms: *instance-seconds* = the sum over
#: instances of the time each is in the rollout pool (from the run start or its join, to its failure or
#: leave); a *weight load* runs from the moment the driver starts loading a version on a drained instance
#: until the instance holds it (or the load failed or was abandoned); *window* = the measurement window.
METRICS: tuple[Metric, ...] = (
    Metric("throughput_tokens_per_s", "run", "prompt+response tokens of the window's steps / window wall seconds"),
    Metric("mean_step_time_s", "run", "window wall seconds / window steps (a step lasts from the previous step's end)"),
    Metric("rollout_only_fraction", "run", "sum of the window steps' wait_s (trainer idle, waiting for its batch) "
                                           "/ window wall seconds"),
    Metric("rollout_utilization", "run", "busy request-slot-seconds / (slots per instance x instance-seconds), window"),
    Metric("weight_sync_fraction", "run", "instance-seconds spent in weight loads (every version switch) / "
                                          "instance-seconds, window"),
    Metric("rebalance_fraction", "run", "instance-seconds spent in weight loads a rebalance ordered (SwitchVersion."
                                        "rebalance: the instance moved between live versions) / instance-seconds, "
                                        "window; null in modes without a rebalancer"),
    Metric("trainer_sync_fraction", "run", "sum of the window steps' sync_s (trainer-side weight sync) / window wall "
                                           "seconds"),
    Metric("rollout_vs_trainer_logprob_diff_mean", "run", "mean over the steps that measured it of "
                                                          "train/rollout_vs_trainer_logprob_diff; null if none did"),
    Metric("rollout_vs_trainer_logprob_diff_max", "run", "max of the same; null if no step measured it"),
    Metric("rollout_vs_trainer_logprob_diff_steps", "run", "steps that measured it"),
    Metric("router_topk_agreement", "run", "mean of train/router_topk_agreement over the steps that measured it"),
    Metric("router_topk_agreement_min", "run", "its minimum"),
    Metric("routing_replay_steps", "run", "steps trained with routing replay (train/routing_replay)"),
    Metric("reward_errors", "run", "sum of reward/errors over the run's steps: trained samples whose reward "
                                   "function failed (scored 0); null without rewards (the simulator)"),
    Metric("trainer_peak_memory_bytes", "run", "max over the steps of perf/trainer_peak_memory_bytes; null if the "
                                               "trainer reported none"),
    Metric("trainer_tokens_per_s", "run", "mean of perf/trainer_tokens_per_s over the window's steps"),
    Metric("trainer_mfu", "run", "mean of perf/trainer_mfu over the window's steps (null off GPU)"),
    Metric("turns_per_trajectory_mean", "run", "model turns per trajectory, over the run's multi-turn trajectories "
                                               "(rollout.workflow; the simulator's workload.turns); null without any"),
    Metric("tokens_per_turn_mean", "run", "model-generated tokens / model turns, over the same trajectories"),
    Metric("tool_latency_s_mean", "run", "wall seconds per tool call, over the run's tool calls; null without any"),
    Metric("tool_use_rate", "run", "share of the run's trajectories with at least one well-formed tool call"),
    Metric("reward/mean", "step", "mean reward of the step's samples (null without rewards: the simulator)"),
    Metric("reward/exact_fraction", "step", "share of the step's samples with reward 1.0"),
    Metric("reward/errors", "step", "samples of the step whose reward function failed (raised or timed out; scored "
                                    "0); null without rewards (the simulator)"),
    Metric("response_length/p50", "step", "median response tokens of the step's samples"),
    Metric("response_length/p99", "step", "99th percentile of the same"),
    Metric("response_length/max", "step", "longest response of the step"),
    Metric("perf/bubble", "step", "(max L - mean L) / max L over the step's response lengths L"),
    Metric("perf/throughput_tokens_per_s", "step", "prompt+response tokens of every step so far / this step's end"),
    Metric("perf/step_time_s", "step", "this step's end - the previous step's end (0 for the first step)"),
    Metric("perf/wait_time_s", "step", "wait_s: the trainer idle waiting for this step's batch"),
    Metric("perf/train_time_s", "step", "train_s: training compute of the step (the trainer's own measure when "
                                        "it reports one, else the train call)"),
    Metric("perf/sync_time_s", "step", "sync_s: seconds inside the step's interval the trainer spent making "
                                       "weights available to rollout: the snapshot export (as the trainer "
                                       "measures it) plus each broadcast to instances (the call, as the "
                                       "controller measures it; the simulator: trainer_push_s / the role swaps)"),
    Metric("perf/weight_sync_time_s", "step", "instance-seconds of weight loads inside the step's interval "
                                              "(all instances, not cumulative)"),
    Metric("perf/rebalance_time_s", "step", "the part of perf/weight_sync_time_s a rebalance ordered (null "
                                            "without a rebalancer)"),
    Metric("perf/rollout_only_fraction", "step", "sum of wait_s of every step so far / this step's end"),
    Metric("perf/rollout_utilization", "step", "busy request-slot-seconds so far / (slots per instance x "
                                               "instance-seconds so far)"),
    Metric("perf/trainer_peak_memory_bytes", "step", "the trainer's peak memory during the step, max over its ranks: "
                                                     "CUDA max_memory_allocated on GPU, peak resident set on CPU "
                                                     "(null when the trainer does not report it: the simulator)"),
    Metric("perf/trainer_tokens_per_s", "step", "prompt+response tokens of the step / the trainer's own step seconds "
                                                "(log-prob pass, forward, backward, optimizer)"),
    Metric("perf/trainer_mfu", "step", "model FLOPs of the step (3 forwards of the real tokens, plus the log-prob "
                                       "forward when the loss needs it) / (step seconds x ranks x GPU peak); null "
                                       "off GPU or when the peak is unknown (trainer.peak_tflops)"),
    Metric("staleness/mean", "step", "mean t - w over the step's groups"),
    Metric("staleness/max", "step", "max t - w over the step's groups"),
    Metric("versions/live", "step", "weight versions live (with work) when the step ended"),
    Metric("migrations/count", "step", "request migrations so far (run total, as the driver counts them)"),
    Metric("migrations/kv_bytes", "step", "KV bytes migrated so far (run total)"),
    Metric("migrations/reprefill_tokens", "step", "tokens re-prefilled so far (run total)"),
    Metric("env/turns_per_trajectory", "step", "model turns per trajectory, over the trajectories that finished in "
                                               "the step's interval (null without multi-turn trajectories)"),
    Metric("env/tokens_per_turn", "step", "model-generated tokens / model turns of the same trajectories"),
    Metric("env/tool_latency_s", "step", "wall seconds per tool call of the same trajectories (null without calls)"),
    Metric("env/tool_use_rate", "step", "share of the same trajectories with at least one well-formed tool call "
                                        "(a <tool_call> block that parsed, whatever the tool answered)"),
    Metric("env/tool_errors", "step", "tool calls of the same trajectories whose result was an error (a raise, a "
                                      "hang, garbage, an unknown tool, a malformed call)"),
    Metric("env/tool_timeouts", "step", "the part of env/tool_errors that were hangs past the time limit"),
)
STEP_KEYS: tuple[str, ...] = tuple(m.key for m in METRICS if m.scope == "step")
#: summary.json keys the recorder adds after the DESIGN section 11 fields
RUN_EXTRA_KEYS: tuple[str, ...] = tuple(m.key for m in METRICS if m.scope == "run" and m.key not in SUMMARY_FIELDS)


def _pct(sorted_values: list[int], q: float) -> float | None:
    if not sorted_values:
        return None
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


class MetricsRecorder:
    """Fed by the driver's events (in time order); see the module docstring.

    ``slots_per_instance``: request slots of one instance (the utilization denominator);
    ``rebalancer``: the mode rebalances (else ``rebalance_fraction`` is null); ``sinks``: scalar
    writers (:class:`~dora_megatron.observability.tensorboard.ScalarWriter`: TensorBoard, W&B,
    :class:`StepsJsonl`) that receive each step's row."""

    def __init__(self, *, slots_per_instance: int, rebalancer: bool, warmup_steps: int = 0,
                 sinks: Sequence[ScalarWriter] = ()) -> None:
        self.slots_per_instance = slots_per_instance
        self.rebalancer = rebalancer
        self.warmup_steps = warmup_steps
        self.sinks = list(sinks)
        self.rows: list[StepRecord] = []  # the run's steps (restored on resume)
        self.last: dict[str, Any] = {}  # the latest step's scalars
        self._ends: list[float] = []
        self._open: dict[tuple[str, str], float] = {}  # (kind, key) -> start of its part not yet attributed
        self._tail: dict[str, float] = {}  # seconds after the last step's end: the next step's
        self._so_far: dict[str, float] = {}  # seconds attributed to steps already ended
        self._syncs = 0  # broadcasts started (their tokens)
        self._trajectories = TrajectoryTotals()  # trajectories finished since the last step's end

    # ------------------------------------------------------------------ events
    def instance_joined(self, instance: str, now: float) -> None:
        self._begin(INSTANCE, instance, now)

    def instance_left(self, instance: str, now: float) -> None:
        """Failed, removed or paused out of the pool; a load in progress there ends too."""
        self._finish(INSTANCE, instance, now)
        self.weight_sync_finished(instance, now)

    def weight_sync_started(self, instance: str, now: float, *, rebalance: bool = False) -> None:
        """``instance`` starts loading weights (a load still open there ends: the new one replaces it)."""
        self.weight_sync_finished(instance, now)
        self._begin(WEIGHT_SYNC, instance, now)
        if rebalance:
            self._begin(REBALANCE, instance, now)

    def weight_sync_finished(self, instance: str, now: float) -> None:
        self._finish(WEIGHT_SYNC, instance, now)
        self._finish(REBALANCE, instance, now)

    def trainer_sync_started(self, now: float) -> str:
        """The trainer starts sending weights (one broadcast to instances); returns the token that
        :meth:`trainer_sync_finished` takes. Broadcasts that overlap (the controller may have several
        calls outstanding) each count their own duration."""
        self._syncs += 1
        token = f"trainer-{self._syncs}"
        self._begin(TRAINER_SYNC, token, now)
        return token

    def trainer_sync_finished(self, token: str, now: float) -> None:
        self._finish(TRAINER_SYNC, token, now)

    def trainer_sync(self, start: float, end: float) -> None:
        """A trainer-side sync measured as a whole (the snapshot export the trainer reports)."""
        self._spread(TRAINER_SYNC, start, end)

    def request_held_slot(self, start: float, end: float) -> None:
        """One request occupied a slot from ``start`` to ``end`` (the runtime: one ``/generate``)."""
        self._spread(BUSY_SLOT, start, end)

    def busy_slot_seconds(self, seconds: float) -> None:
        """Busy slot-seconds of the step now running, for a driver that integrates slot occupancy
        itself (the simulator's instance model)."""
        self._tail[BUSY_SLOT] = self._tail.get(BUSY_SLOT, 0.0) + max(0.0, seconds)

    def trajectory_finished(self, stats: TrajectoryStats) -> None:
        """A multi-turn trajectory finished (counted in the step now running)."""
        self._trajectories.add(stats)

    def step_trained(self, step: int, *, end_s: float, wait_s: float, train_s: float, tokens: int,
                     staleness: Sequence[int], rewards: Sequence[float], response_lengths: Sequence[int],
                     live_versions: int, metrics: Mapping[str, Any] | None = None, migrations: int = 0,
                     migrated_kv_bytes: float = 0, reprefill_tokens: int = 0,
                     reward_errors: int | None = None, groups: Sequence[str] = (),
                     versions: Sequence[int] = ()) -> dict[str, Any]:
        """Step ``step`` ended at ``end_s``: close its interval, record it (:attr:`rows`' last
        :class:`StepRecord`), hand its scalars to the sinks, return them.
        ``migrations``/``migrated_kv_bytes``/``reprefill_tokens``: the driver's run totals so far;
        ``reward_errors``: the step's samples whose reward function failed (None: no rewards);
        ``groups``/``versions``: the consumed groups and their versions, as the batch released them."""
        end_s = max(end_s, self._ends[-1] if self._ends else 0.0)
        for (kind, key), start in list(self._open.items()):
            self._spread(kind, start, end_s)
            self._open[(kind, key)] = max(start, end_s)
        row = StepRecord(step, end_s, wait_s, train_s, tokens, list(staleness),
                         statistics.fmean(rewards) if rewards else None, dict(metrics or {}), dict(self._tail),
                         self._trajectories.as_dict(), reward_errors, list(groups), [int(v) for v in versions],
                         len(response_lengths))
        self._trajectories = TrajectoryTotals()
        self._close(row)
        self.last = self._scalars(row, rewards, sorted(response_lengths), live_versions,
                                  (migrations, migrated_kv_bytes, reprefill_tokens))
        for sink in self.sinks:
            if isinstance(sink, StepsJsonl):  # the run's step record: the row goes with its scalars
                sink.step(step, self.last, dataclasses.asdict(row))
            else:
                sink.scalars(step, self.last)
        return self.last

    # ------------------------------------------------------------------ outputs
    def summary(self, *, mode: str, max_staleness: int, tbs: int, rbs: int, totals: RunTotals,
                wall_time_s: float) -> dict[str, Any]:
        """The run's summary (:func:`~dora_megatron.observability.summary.build_summary` over its step
        records). ``totals``: the driver's counts (groups, violations, migrations)."""
        return build_summary(mode=mode, max_staleness=max_staleness, tbs=tbs, rbs=rbs, steps=self.rows, totals=totals,
                             wall_time_s=wall_time_s, warmup_steps=self.warmup_steps,
                             slots_per_instance=self.slots_per_instance, rebalancer=self.rebalancer)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the recorder: the seconds after the last step's end. Not the
        per-step rows (they grow with the run): :class:`StepsJsonl` writes each with its step's line,
        and a resumed run takes them back from there (:func:`read_step_rows`). Open spans are not
        kept: a resumed run starts fresh instances."""
        return {"tail": dict(self._tail)}

    def load_state_dict(self, state: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] = ()) -> None:
        """Continue from :meth:`state_dict` and the rows of the steps done (``rows``, steps.jsonl's)."""
        self.rows, self._ends, self._so_far = [], [], {}
        for d in rows:
            self._close(StepRecord(**d))
        self._tail = dict(state["tail"])

    # ------------------------------------------------------------------ internals
    def _begin(self, kind: str, key: str, now: float) -> None:
        self._finish(kind, key, now)
        self._open[(kind, key)] = now

    def _finish(self, kind: str, key: str, now: float) -> None:
        start = self._open.pop((kind, key), None)
        if start is not None:
            self._spread(kind, start, now)

    def _spread(self, kind: str, start: float, end: float) -> None:
        """Add ``[start, end]`` to the step intervals it overlaps; the part after the last step's end
        goes to the step now running."""
        if end <= start:
            return
        i = bisect.bisect_right(self._ends, start)  # step i's interval is (ends[i-1], ends[i]]
        lo = start
        while i < len(self._ends) and lo < end:
            hi = min(end, self._ends[i])
            if hi > lo:
                seconds = self.rows[i].seconds
                seconds[kind] = seconds.get(kind, 0.0) + hi - lo
                self._so_far[kind] = self._so_far.get(kind, 0.0) + hi - lo
            lo, i = max(lo, hi), i + 1
        if end > lo:
            self._tail[kind] = self._tail.get(kind, 0.0) + end - lo

    def _close(self, row: StepRecord) -> None:
        self.rows.append(row)
        self._ends.append(row.end_s)
        for kind, s in row.seconds.items():
            self._so_far[kind] = self._so_far.get(kind, 0.0) + s
        self._so_far["tokens"] = self._so_far.get("tokens", 0.0) + row.tokens
        self._so_far["wait"] = self._so_far.get("wait", 0.0) + row.wait_s
        self._tail = {}

    def _scalars(self, row: StepRecord, rewards: Sequence[float], lengths: list[int], live_versions: int,
                 migrations: tuple[int, float, int]) -> dict[str, Any]:
        prev_end = self.rows[-2].end_s if len(self.rows) > 1 else 0.0
        end, sec, so_far = row.end_s, row.seconds, self._so_far
        instance_s = so_far.get(INSTANCE, 0.0)
        max_len = lengths[-1] if lengths else 0
        out: dict[str, Any] = {
            "reward/mean": row.reward,
            "reward/exact_fraction": sum(r == 1.0 for r in rewards) / len(rewards) if rewards else None,
            "reward/errors": row.reward_errors,
            "response_length/p50": _pct(lengths, 0.5), "response_length/p99": _pct(lengths, 0.99),
            "response_length/max": lengths[-1] if lengths else None,
            "perf/bubble": (max_len - statistics.fmean(lengths)) / max_len if max_len else None,
            "perf/throughput_tokens_per_s": so_far["tokens"] / end if end > 0 else None,
            "perf/step_time_s": end - prev_end,
            "perf/wait_time_s": row.wait_s,
            "perf/train_time_s": row.train_s,
            "perf/sync_time_s": sec.get(TRAINER_SYNC, 0.0),
            "perf/weight_sync_time_s": sec.get(WEIGHT_SYNC, 0.0),
            "perf/rebalance_time_s": sec.get(REBALANCE, 0.0) if self.rebalancer else None,
            "perf/rollout_only_fraction": so_far["wait"] / end if end > 0 else None,
            "perf/rollout_utilization": (so_far.get(BUSY_SLOT, 0.0) / (self.slots_per_instance * instance_s)
                                         if instance_s > 0 and self.slots_per_instance else None),
            "staleness/mean": statistics.fmean(row.staleness) if row.staleness else None,
            "staleness/max": max(row.staleness) if row.staleness else None,
            "versions/live": live_versions,
            "migrations/count": migrations[0], "migrations/kv_bytes": migrations[1],
            "migrations/reprefill_tokens": migrations[2],
        }
        for key, value in TrajectoryTotals.total([row.trajectories]).scalars().items():
            out[f"env/{key}"] = value
        for key in TRAINER_PERF_KEYS:  # the trainer's measures of its own step, under their own names
            out[key] = row.metrics.get(key)
        for key, value in row.metrics.items():
            if key not in TRAINER_PERF_KEYS:
                out[f"train/{key}"] = value
        return out


class StepsJsonl:
    """``steps.jsonl``: one JSON object per step, ``{"step": k, <every scalar>}``; a metric that does not
    apply is null, never omitted (as in summary.json). Written by the recorder, a line also holds
    the recorder's row of the step under :data:`ROW_KEY` (what a resumed run's summary needs of the
    steps before its checkpoint; see :func:`read_step_rows`)."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()

    def step(self, step: int, values: Mapping[str, Any], row: Mapping[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **values, ROW_KEY: row}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


#: the key of a ``steps.jsonl`` line that holds the recorder's row of its step
ROW_KEY = "recorder_row"


def read_step_rows(path: Path, steps: int) -> list[dict[str, Any]]:
    """The recorder's rows of steps ``0 .. steps-1`` from a ``steps.jsonl`` (the newest line of a
    step wins: a crashed lineage's lines of steps after the checkpoint are dropped before a resume,
    but a file cut by hand may still hold them). A line torn by a crash, or one written without a
    row, is skipped; a missing step is logged (the resumed run's summary then lacks it)."""
    found: dict[int, dict[str, Any]] = {}
    text = path.read_text() if path.is_file() else ""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            step = int(entry["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if 0 <= step < steps and isinstance(entry.get(ROW_KEY), dict):
            found[step] = entry[ROW_KEY]
    missing = [k for k in range(steps) if k not in found]
    if missing:
        log.warning("%s: no recorder row for %d of the %d steps done (first: step %d): the summary of the "
                    "resumed run leaves them out", path, len(missing), steps, missing[0])
    return [found[k] for k in sorted(found)]
