"""The run summary of DESIGN section 11, built by one pure function.

WHY here and pure: the simulator, ``dora train`` and ``dora bench`` must report the same fields
with the same definitions (DESIGN section 9), so the arithmetic lives in one function that takes
plain records and returns a JSON-ready dict. It imports nothing heavy.

Every metric's definition is written once, in :data:`dora_megatron.observability.recorder.METRICS`;
this module is the arithmetic of the run-level ones. The drivers do not call it directly: they
feed events to :class:`~dora_megatron.observability.recorder.MetricsRecorder`, which measures
the instance-seconds, weight-load seconds and busy slot-seconds of the window and calls it.

Rate metrics are computed over a *measurement window*: the steps with index >= ``warmup_steps``
(the paper averages steps after warm-up). The window's wall time runs from the end of the last
warm-up step (or time 0) to the end of the last step. Counting fields (dispatched, consumed,
violations, histogram) always cover the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

#: Every key ``summary.json`` must carry (DESIGN section 11), in order.
SUMMARY_FIELDS: tuple[str, ...] = (
    "mode", "max_staleness", "tbs", "rbs", "steps", "dispatched_groups", "consumed_groups", "lost_groups",
    "duplicated_groups", "c1_violations", "c3_violations", "max_consumed_staleness", "staleness_histogram",
    "throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "rollout_utilization",
    "weight_sync_fraction", "rebalance_fraction", "migrations", "migrated_kv_bytes", "reprefill_tokens",
    "reward_first", "reward_last", "wall_time_s",
)


@dataclass
class StepRecord:
    """One training step as the trainer saw it (times in seconds since the run start)."""

    step: int
    end_s: float  # when the step (training + weight push) finished
    wait_s: float  # trainer idle waiting for the batch of this step (the rollout-only time)
    train_s: float  # training compute of this step
    sync_s: float  # trainer-side weight sync inside the step's interval (snapshot export, broadcasts)
    tokens: int  # prompt+response tokens of the consumed groups
    staleness: Sequence[int] = ()  # t - w of each consumed group
    reward: float | None = None  # mean reward of the batch, when known


@dataclass
class RunTotals:
    """Run-wide counters (integers over the whole run; *_s in seconds over the window)."""

    dispatched_groups: int
    consumed_groups: int
    lost_groups: int | None = 0
    duplicated_groups: int | None = 0
    c1_violations: int | None = 0
    c3_violations: int | None = 0
    migrations: int | None = 0
    migrated_kv_bytes: float | None = 0
    reprefill_tokens: int | None = 0
    busy_slot_s: float | None = None  # request-slot-seconds busy inside the window
    slots_per_instance: int | None = None  # request slots of one instance (the cap)
    instance_s: float | None = None  # instance-seconds in the rollout pool inside the window
    weight_sync_s: float | None = None  # instance-seconds loading weights inside the window
    rebalance_s: float | None = None  # the part of weight_sync_s a rebalance ordered (None: no rebalancer)
    extra: dict[str, Any] = field(default_factory=dict)


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
) -> dict[str, Any]:
    """Return the DESIGN section 11 summary dict: every field present, null when not applicable."""
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

    def frac(x: float | None) -> float | None:
        return None if x is None or span <= 0 else x / span

    # every window step, the first one included, from the end of the step before it (the last
    # warm-up step, or time 0): the window's mean step time is then span / steps, as throughput's
    ends = [t0] + [s.end_s for s in window]
    step_times = [b - a for a, b in zip(ends, ends[1:])]
    def per_instance_s(x: float | None) -> float | None:
        return None if x is None or not totals.instance_s else x / totals.instance_s

    util = None
    if totals.busy_slot_s is not None and totals.slots_per_instance:
        util = per_instance_s(totals.busy_slot_s / totals.slots_per_instance)
    reward_first, reward_last = reward_window(steps)
    return {
        "mode": mode,
        "max_staleness": max_staleness,
        "tbs": tbs,
        "rbs": rbs,
        "steps": len(steps),
        "dispatched_groups": totals.dispatched_groups,
        "consumed_groups": totals.consumed_groups,
        "lost_groups": totals.lost_groups,
        "duplicated_groups": totals.duplicated_groups,
        "c1_violations": totals.c1_violations,
        "c3_violations": totals.c3_violations,
        "max_consumed_staleness": max(hist) if hist else None,
        "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
        "throughput_tokens_per_s": (sum(s.tokens for s in window) / span) if span > 0 and window else None,
        "mean_step_time_s": _mean(step_times),
        "rollout_only_fraction": frac(sum(s.wait_s for s in window)) if window else None,
        "rollout_utilization": util,
        "weight_sync_fraction": per_instance_s(totals.weight_sync_s),
        "rebalance_fraction": per_instance_s(totals.rebalance_s),
        "migrations": totals.migrations,
        "migrated_kv_bytes": totals.migrated_kv_bytes,
        "reprefill_tokens": totals.reprefill_tokens,
        "reward_first": reward_first,
        "reward_last": reward_last,
        "wall_time_s": wall_time_s,
    }
