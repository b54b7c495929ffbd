"""The metrics recorder on hand-made event sequences: how durations are split over step intervals,
what closes an open span, the window, and resume."""

import pytest

from dora_megatron.observability.recorder import METRICS, STEP_KEYS, MetricsRecorder, StepsJsonl, read_step_rows
from dora_megatron.observability.summary import RunTotals


def _step(rec, step, end, wait=0.0, **kw):
    return rec.step_trained(step, end_s=end, wait_s=wait, train_s=1.0, tokens=100, staleness=[0],
                            rewards=[1.0, 0.0], response_lengths=[10, 30], live_versions=1, **kw)


def _summary(rec):
    return rec.summary(mode="dora", max_staleness=1, tbs=1, rbs=2, wall_time_s=30.0,
                       totals=RunTotals(dispatched_groups=3, consumed_groups=3))


def test_a_load_across_a_step_end_is_split_and_nothing_accumulates():
    rec = MetricsRecorder(slots_per_instance=2, rebalancer=True)
    rec.instance_joined("a", 0.0)
    rec.instance_joined("b", 0.0)
    rec.weight_sync_started("a", 8.0, rebalance=True)
    s0 = _step(rec, 0, 10.0)
    rec.weight_sync_finished("a", 12.0)
    s1 = _step(rec, 1, 20.0)
    rec.weight_sync_started("b", 21.0)  # not a rebalance: weight sync only
    rec.weight_sync_finished("b", 22.0)
    s2 = _step(rec, 2, 30.0)
    assert [s["perf/weight_sync_time_s"] for s in (s0, s1, s2)] == [2.0, 2.0, 1.0]
    assert [s["perf/rebalance_time_s"] for s in (s0, s1, s2)] == [2.0, 2.0, 0.0]
    assert [s["perf/step_time_s"] for s in (s0, s1, s2)] == [10.0, 10.0, 10.0]
    out = _summary(rec)
    assert out["weight_sync_fraction"] == pytest.approx(5.0 / 60.0)  # 2 instances x 30 s
    assert out["rebalance_fraction"] == pytest.approx(4.0 / 60.0)


def test_leaving_the_pool_ends_a_load_and_the_instance_time():
    rec = MetricsRecorder(slots_per_instance=1, rebalancer=False)
    rec.instance_joined("a", 0.0)
    rec.instance_joined("b", 0.0)
    rec.weight_sync_started("b", 2.0)
    rec.instance_left("b", 5.0)  # failed while loading
    s0 = _step(rec, 0, 10.0)
    assert s0["perf/weight_sync_time_s"] == 3.0 and s0["perf/rebalance_time_s"] is None
    out = _summary(rec)
    assert out["weight_sync_fraction"] == pytest.approx(3.0 / 15.0)  # a: 10 s, b: 5 s in the pool
    assert out["rebalance_fraction"] is None


def _recording(tmp_path, **kw):
    """A recorder that writes steps.jsonl, as a run's does (its rows are what a resume reads back)."""
    return MetricsRecorder(sinks=[StepsJsonl(open(tmp_path / "steps.jsonl", "w"))], **kw)


def _resumed(rec, tmp_path, **kw):
    """A fresh recorder continued from ``rec``'s checkpoint state and the rows of steps.jsonl."""
    rec.sinks[0].close()
    again = MetricsRecorder(**kw)
    again.load_state_dict(rec.state_dict(), rows=read_step_rows(tmp_path / "steps.jsonl", len(rec.rows)))
    return again


def test_busy_slots_reported_late_land_in_the_steps_they_overlap(tmp_path):
    rec = _recording(tmp_path, slots_per_instance=2, rebalancer=False)
    rec.instance_joined("a", 0.0)
    _step(rec, 0, 10.0)
    rec.request_held_slot(5.0, 15.0)  # a request that ran across the end of step 0
    s1 = _step(rec, 1, 20.0)
    assert [r.seconds["busy_slot"] for r in rec.rows] == [5.0, 5.0]
    assert s1["perf/rollout_utilization"] == pytest.approx(10.0 / (2 * 20.0))
    rec2 = _resumed(rec, tmp_path, slots_per_instance=2, rebalancer=False, warmup_steps=1)
    assert _summary(rec2)["rollout_utilization"] == pytest.approx(5.0 / (2 * 10.0))  # step 1 only


def test_resume_restores_the_steps_and_the_window(tmp_path):
    rec = _recording(tmp_path, slots_per_instance=1, rebalancer=True)
    rec.instance_joined("a", 0.0)
    _step(rec, 0, 10.0, wait=4.0)
    assert "rows" not in rec.state_dict()  # the checkpoint does not grow with the steps: steps.jsonl has them
    again = _resumed(rec, tmp_path, slots_per_instance=1, rebalancer=True)
    again.instance_joined("a", 10.0)  # a fresh instance after the resume
    s1 = _step(again, 1, 20.0, wait=2.0)
    assert s1["perf/rollout_only_fraction"] == pytest.approx(6.0 / 20.0)
    assert s1["perf/throughput_tokens_per_s"] == pytest.approx(200 / 20.0)
    out = _summary(again)
    assert out["steps"] == 2 and out["rollout_only_fraction"] == pytest.approx(6.0 / 20.0)


def test_every_emitted_key_is_defined_once():
    keys = [m.key for m in METRICS]
    assert len(keys) == len(set(keys))
    rec = MetricsRecorder(slots_per_instance=1, rebalancer=True)
    row = _step(rec, 0, 1.0, metrics={"loss": 0.5})
    assert set(row) == set(STEP_KEYS) | {"train/loss"}


def test_trainer_perf_is_logged_under_its_own_names_and_summarised():
    rec = MetricsRecorder(slots_per_instance=1, rebalancer=True, warmup_steps=1)
    rows = [_step(rec, k, float(k + 1), metrics={"loss": 0.5, "lr": 1e-3 * (k + 1),
                                                 "perf/trainer_peak_memory_bytes": peak,
                                                 "perf/trainer_tokens_per_s": tps})
            for k, (peak, tps) in enumerate([(5e9, 100.0), (7e9, 300.0), (6e9, 500.0)])]
    assert rows[1]["perf/trainer_peak_memory_bytes"] == 7e9 and rows[1]["train/lr"] == 2e-3
    assert "train/perf/trainer_tokens_per_s" not in rows[1] and rows[1]["perf/trainer_mfu"] is None
    out = _summary(rec)
    assert out["trainer_peak_memory_bytes"] == 7e9  # the whole run
    assert out["trainer_tokens_per_s"] == 400.0  # the window: steps 1 and 2
    assert out["trainer_mfu"] is None


def test_trajectories_are_counted_in_the_step_they_finish_in_and_summed_for_the_run(tmp_path):
    from dora_megatron.observability.trajectories import TrajectoryStats

    rec = _recording(tmp_path, slots_per_instance=1, rebalancer=False)
    s0 = _step(rec, 0, 10.0)  # a single-turn step: nothing applies
    assert s0["env/turns_per_trajectory"] is None and s0["env/tool_use_rate"] is None and s0["env/tool_errors"] is None
    rec.trajectory_finished(TrajectoryStats(turns=3, model_tokens=30, tool_calls=2, well_formed_calls=2,
                                            tool_latency_s=1.0, tool_errors=1))
    rec.trajectory_finished(TrajectoryStats(turns=1, model_tokens=10, tool_calls=1, tool_errors=1))  # malformed only
    s1 = _step(rec, 1, 20.0)
    assert s1["env/turns_per_trajectory"] == 2.0 and s1["env/tokens_per_turn"] == 10.0
    assert s1["env/tool_latency_s"] == pytest.approx(1.0 / 3) and s1["env/tool_use_rate"] == 0.5
    assert s1["env/tool_errors"] == 2 and s1["env/tool_timeouts"] == 0
    rec.trajectory_finished(TrajectoryStats(turns=2, model_tokens=40, tool_calls=1, well_formed_calls=1,
                                            tool_latency_s=5.0, tool_timeouts=1, tool_errors=1))
    s2 = _step(rec, 2, 30.0)
    assert s2["env/turns_per_trajectory"] == 2.0 and s2["env/tool_latency_s"] == 5.0 and s2["env/tool_timeouts"] == 1
    again = _resumed(rec, tmp_path, slots_per_instance=1, rebalancer=False)  # the run's sums come back from steps.jsonl
    for r in (rec, again):
        out = _summary(r)
        assert out["turns_per_trajectory_mean"] == 2.0 and out["tokens_per_turn_mean"] == 80 / 6
        assert out["tool_latency_s_mean"] == 1.5 and out["tool_use_rate"] == pytest.approx(2 / 3)
