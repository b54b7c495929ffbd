"""The DESIGN section 11 summary: every field present, the section 9 definitions, nulls."""

import pytest

from dora_megatron.observability.recorder import RUN_EXTRA_KEYS
from dora_megatron.observability.summary import SUMMARY_FIELDS, RunTotals, StepRecord, build_summary


def _steps(seconds=({}, {}, {})):
    # three steps ending at 100, 250, 400 s; waits 60, 10, 0; tokens 1000 each
    return [StepRecord(0, 100.0, 60.0, 30.0, 1000, [0, 0], reward=0.1, seconds=dict(seconds[0])),
            StepRecord(1, 250.0, 10.0, 130.0, 1000, [0, 1], reward=0.2, seconds=dict(seconds[1])),
            StepRecord(2, 400.0, 0.0, 140.0, 1000, [1, 2], reward=0.5, seconds=dict(seconds[2]))]


def test_every_field_present_in_order():
    s = build_summary(mode="dora", max_staleness=2, tbs=2, rbs=4, steps=_steps(),
                      totals=RunTotals(dispatched_groups=8, consumed_groups=6), wall_time_s=400.0)
    assert tuple(s) == SUMMARY_FIELDS + RUN_EXTRA_KEYS  # the section 11 fields, then the recorder's


def test_definitions_over_the_whole_run():
    # two instances in the pool for the whole 400 s (200, 300, 300 instance-seconds a step: 800);
    # busy slots 400 s, weight loads 30 s (8 of them a rebalance's)
    per_step = ({"instance": 200.0, "busy_slot": 100.0, "weight_sync": 10.0, "rebalance": 8.0},
                {"instance": 300.0, "busy_slot": 150.0, "weight_sync": 10.0},
                {"instance": 300.0, "busy_slot": 150.0, "weight_sync": 10.0})
    totals = RunTotals(dispatched_groups=8, consumed_groups=6)
    s = build_summary(mode="dora", max_staleness=2, tbs=2, rbs=4, steps=_steps(per_step), totals=totals,
                      wall_time_s=400.0, slots_per_instance=4)
    assert s["throughput_tokens_per_s"] == pytest.approx(3000 / 400)
    assert s["rollout_only_fraction"] == pytest.approx(70 / 400)
    assert s["weight_sync_fraction"] == pytest.approx(30 / 800)
    assert s["rollout_utilization"] == pytest.approx(400 / (4 * 800))
    assert s["rebalance_fraction"] == pytest.approx(8 / 800)
    assert s["mean_step_time_s"] == pytest.approx(400 / 3)
    assert s["staleness_histogram"] == {"0": 3, "1": 2, "2": 1}
    assert s["max_consumed_staleness"] == 2
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.5)


def test_warmup_window_excludes_first_steps():
    s = build_summary(mode="sync", max_staleness=0, tbs=2, rbs=2, steps=_steps(),
                      totals=RunTotals(dispatched_groups=6, consumed_groups=6), wall_time_s=400.0, warmup_steps=1)
    assert s["throughput_tokens_per_s"] == pytest.approx(2000 / 300)
    assert s["rollout_only_fraction"] == pytest.approx(10 / 300)
    assert s["mean_step_time_s"] == pytest.approx(150)
    assert s["steps"] == 3  # counts cover the whole run


def test_window_step_time_counts_the_first_step_after_the_warmup():
    # steps end at 100, 250, 480 s: after one warm-up step the window holds steps of 150 s and 230 s
    steps = _steps()
    steps[2].end_s = 480.0
    s = build_summary(mode="sync", max_staleness=0, tbs=2, rbs=2, steps=steps,
                      totals=RunTotals(dispatched_groups=6, consumed_groups=6), wall_time_s=480.0, warmup_steps=1)
    assert s["mean_step_time_s"] == pytest.approx((150 + 230) / 2)
    # one measured step (two warm-up steps): its own duration, 480 - 250 s, not null
    s = build_summary(mode="sync", max_staleness=0, tbs=2, rbs=2, steps=steps,
                      totals=RunTotals(dispatched_groups=6, consumed_groups=6), wall_time_s=480.0, warmup_steps=2)
    assert s["mean_step_time_s"] == pytest.approx(230)


def test_not_applicable_is_null_not_missing():
    steps = [StepRecord(0, 50.0, 5.0, 40.0, 10)]
    s = build_summary(mode="sync", max_staleness=0, tbs=1, rbs=1, steps=steps,
                      totals=RunTotals(dispatched_groups=1, consumed_groups=1), wall_time_s=50.0, rebalancer=False)
    for key in ("reward_first", "reward_last", "rollout_utilization", "rebalance_fraction", "max_consumed_staleness"):
        assert key in s and s[key] is None


def test_duplicated_groups_counts_each_listing_after_the_first():
    steps = _steps()
    steps[0].groups, steps[1].groups, steps[2].groups = ["a", "b"], ["c", "a"], ["a", "d", "d"]
    s = build_summary(mode="dora", max_staleness=2, tbs=2, rbs=4, steps=steps,
                      totals=RunTotals(dispatched_groups=8, consumed_groups=6), wall_time_s=400.0)
    assert s["duplicated_groups"] == 3  # "a" twice more, "d" once more
