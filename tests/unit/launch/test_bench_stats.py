"""`dora bench` statistics: paired ratio intervals and time-to-reward (pure functions, fake runs)."""

from __future__ import annotations

import json
import math

import pytest

from dora_megatron.launch.bench import aggregate, learning, learning_table, markdown_table
from dora_megatron.launch.bench_stats import (eval_curve, paired_ratio_ci, reward_curve, t_quantile, time_to_reward,
                                              trailing_mean)


def test_t_quantile_matches_the_published_table():
    # two-sided 95% critical values of Student's t (any statistics textbook's table)
    for df, value in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=2e-3)
    assert t_quantile(0.95, 5) == pytest.approx(2.015, abs=2e-3)
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(0.4, 3)


def test_pairing_by_round_cancels_load_drift_between_rounds():
    # the machine's speed halves and doubles between rounds; within a round A is always 1.2x B
    b = [1000.0, 500.0, 2000.0, 800.0]
    a = [1.2 * x for x in b]
    ci = paired_ratio_ci(a, b)
    assert ci.ratio == pytest.approx(1.2)
    assert ci.lo == pytest.approx(1.2) and ci.hi == pytest.approx(1.2)
    assert ci.above_one and ci.pairs == 4


def test_interval_widens_with_noise_and_says_when_it_does_not_clear_one():
    tight = paired_ratio_ci([110.0, 112.0, 108.0, 111.0], [100.0] * 4)
    noisy = paired_ratio_ci([130.0, 95.0, 125.0, 92.0], [100.0] * 4)
    assert tight.lo < tight.ratio < tight.hi and tight.above_one
    assert noisy.lo < 1.0 < noisy.hi and not noisy.above_one
    assert noisy.hi / noisy.lo > tight.hi / tight.lo
    # a higher confidence level gives a wider interval on the same rounds
    wide = paired_ratio_ci([110.0, 112.0, 108.0, 111.0], [100.0] * 4, level=0.99)
    assert wide.lo < tight.lo and wide.hi > tight.hi
    # the interval is symmetric in log space around the geometric mean
    assert math.log(tight.ratio / tight.lo) == pytest.approx(math.log(tight.hi / tight.ratio))


def test_missing_rounds_are_left_out_and_one_pair_has_no_interval():
    ci = paired_ratio_ci([120.0, None, 0.0], [100.0, 100.0, 100.0])
    assert ci.pairs == 1 and ci.ratio == pytest.approx(1.2) and ci.lo is None and not ci.above_one
    assert paired_ratio_ci([None], [100.0]) is None


def test_trailing_mean_waits_for_a_full_window():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [None, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        trailing_mean([1.0], 0)


def test_time_to_reward_ignores_a_single_lucky_step():
    walls = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    rewards = [0.4, 0.8, 0.4, 0.4, 0.6, 0.7]  # step 1 alone is above 0.55; the 3-step mean first at step 5 (0.567)
    assert time_to_reward(walls, rewards, 0.55, 3) == 5.0
    assert time_to_reward(walls, rewards, 0.55, 1) == 1.0
    assert time_to_reward(walls, rewards, 0.8, 3) is None


def test_reward_curve_sums_step_times_in_step_order_and_skips_steps_without_reward():
    rows = [{"step": 2, "reward/mean": 0.3, "perf/step_time_s": 2.0},
            {"step": 0, "reward/mean": 0.1, "perf/step_time_s": 0.0},
            {"step": 1, "reward/mean": None, "perf/step_time_s": 1.5}]
    assert reward_curve(rows) == ([0.0, 3.5], [0.1, 0.3])


def _write_run(d, step_time, rewards):
    d.mkdir(parents=True)
    d.joinpath("steps.jsonl").write_text("".join(
        json.dumps({"step": i, "reward/mean": r, "perf/step_time_s": 0.0 if i == 0 else step_time}) + "\n"
        for i, r in enumerate(rewards)))
    return d


def test_a_fast_mode_that_learns_less_shows_in_time_to_reward(tmp_path):
    # "fast": half the step time, but its reward stays flat; "slow" climbs to the level
    fast = [_write_run(tmp_path / f"fast-seed{k}", 1.0, [0.40] * 10) for k in range(2)]
    slow = [_write_run(tmp_path / "slow-seed0", 2.0, [0.40, 0.42, 0.45, 0.50, 0.55, 0.60, 0.62, 0.64, 0.66, 0.70]),
            _write_run(tmp_path / "slow-seed1", 2.0, [0.40] * 10)]
    learn = learning({"fast": fast, "slow": slow}, level=0.6, window=3)
    f, s = learn["variants"]["fast"], learn["variants"]["slow"]
    assert f["reached"] == 0 and f["time_to_reward_median_s"] is None
    assert s["reached"] == 1 and s["runs"] == 2
    # the 3-step mean is 0.59 at step 6 (0.55, 0.60, 0.62) and 0.62 at step 7, whose wall time is 7 x 2 s
    assert s["seeds"][0]["time_to_reward_s"] == pytest.approx(14.0)
    assert s["seeds"][1]["time_to_reward_s"] is None
    assert s["seeds"][0]["final_reward"] == pytest.approx((0.64 + 0.66 + 0.70) / 3)
    assert len(s["seeds"][0]["wall_s"]) == len(s["seeds"][0]["reward"]) == 10
    table = learning_table(learn)
    assert "| fast | 0/2 | - |" in table and "| slow | 1/2 | 14.0 | 14.0 / - |" in table


def test_eval_curve_places_each_round_at_the_wall_time_of_its_step():
    steps = [{"step": 0, "perf/step_time_s": 0.0}, {"step": 1, "perf/step_time_s": 2.0},
             {"step": 2, "perf/step_time_s": 3.0}, {"step": 3, "perf/step_time_s": 1.0}]
    # version v exists once steps.jsonl's step v - 1 is trained: the final round (v4) after the last step
    rounds = [{"step": 4, "mean_reward": 0.7, "final": True}, {"step": 2, "mean_reward": 0.2, "final": False},
              {"step": 9, "mean_reward": 0.9, "final": False},  # a version the run never trained: no wall time
              {"step": 3, "mean_reward": None, "final": False}, {"step": 0, "mean_reward": 0.1, "final": False}]
    assert eval_curve(steps, rounds) == ([0.0, 2.0, 6.0], [0.1, 0.2, 0.7])


def _write_eval_run(d, step_time, eval_rewards, trained=0.9):
    d.mkdir(parents=True)
    n = 2 * len(eval_rewards)
    d.joinpath("steps.jsonl").write_text("".join(
        json.dumps({"step": i, "reward/mean": trained, "perf/step_time_s": 0.0 if i == 0 else step_time}) + "\n"
        for i in range(n)))
    d.joinpath("eval.jsonl").write_text("".join(
        json.dumps({"step": 2 * (k + 1), "mean_reward": r, "final": k == len(eval_rewards) - 1}) + "\n"
        for k, r in enumerate(eval_rewards)))
    return d


def test_time_to_reward_on_the_held_out_set_ignores_the_trained_samples_reward(tmp_path):
    # both runs' trained samples score 0.9 from the start (e.g. easy prompts, stale samples);
    # only the eval rounds tell that "slow" reaches 0.6 at its third round and "fast" never
    fast = [_write_eval_run(tmp_path / "fast-seed0", 1.0, [0.3, 0.3, 0.4])]
    slow = [_write_eval_run(tmp_path / "slow-seed0", 2.0, [0.3, 0.5, 0.6])]
    trained = learning({"fast": fast, "slow": slow}, level=0.6, window=3)
    assert trained["variants"]["fast"]["reached"] == 1  # the trained reward says both got there
    held = learning({"fast": fast, "slow": slow}, level=0.6, window=3, source="eval")
    assert held["source"] == "eval" and held["window"] == 1
    assert held["variants"]["fast"]["reached"] == 0
    # the third round evaluates version 6, trained by step 5 (0-based), whose wall time is 5 x 2 s
    assert held["variants"]["slow"]["seeds"][0]["time_to_reward_s"] == pytest.approx(10.0)
    assert held["variants"]["slow"]["seeds"][0]["final_reward"] == pytest.approx(0.6)
    assert "held-out eval set" in learning_table(held)


def test_aggregate_reports_paired_intervals_and_runs_above_their_bound():
    limits = [{"rollout_tokens_per_s": 100.0, "training_tokens_per_s": 200.0},
              {"rollout_tokens_per_s": 50.0, "training_tokens_per_s": 200.0}]
    runs = {"sync_colocated": [{"throughput_tokens_per_s": 60.0}, {"throughput_tokens_per_s": 30.0}],
            "partial": [{"throughput_tokens_per_s": 80.0}, {"throughput_tokens_per_s": 40.0}],
            "dora_s3": [{"throughput_tokens_per_s": 90.0}, {"throughput_tokens_per_s": 55.0}]}
    agg = aggregate(runs, limits=limits)
    ci = agg["ratio_ci"]["dora_s3/partial_throughput"]
    assert ci["pairs"] == 2 and ci["lo"] < ci["ratio"] < ci["hi"]
    assert ci["ratio"] == pytest.approx(math.sqrt(90 / 80 * 55 / 40))
    assert agg["ratio_ci"]["dora_s3/sync_throughput"]["ratio"] == pytest.approx(math.sqrt(1.5 * 55 / 30))
    assert agg["bound_exceeded"] == ["dora_s3-seed1"]  # 55 against a bound of 50 in round 1
    table = markdown_table(agg)
    assert "`dora_s3/partial_throughput`" in table and "Runs above their round's bound: dora_s3-seed1." in table


def test_write_results_puts_curves_intervals_and_times_in_the_bench_outputs(tmp_path):
    from pathlib import Path

    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.bench import write_results

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs" / "bench" / "cpu_longtail.yaml",
                      ["bench.variants=[sync_colocated,dora_s3]", "bench.seeds=2", "bench.limits=false",
                       "bench.reward_level=0.5", "bench.reward_window=2"])
    dirs = {v: [_write_run(tmp_path / "runs" / f"{v}-seed{k}", t, [0.4, 0.5, 0.6]) for k in range(2)]
            for v, t in (("sync_colocated", 2.0), ("dora_s3", 1.0))}
    runs = {"sync_colocated": [{"throughput_tokens_per_s": 100.0}, {"throughput_tokens_per_s": 90.0}],
            "dora_s3": [{"throughput_tokens_per_s": 130.0}, {"throughput_tokens_per_s": 120.0}]}
    result = write_results(cfg, tmp_path, runs, dirs, {}, 2, say=lambda _: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    # the 2-step mean first reaches 0.5 at step 2 (0.55), after two steps of 1 s (dora) or 2 s (sync)
    assert saved["learning"]["variants"]["dora_s3"]["time_to_reward_median_s"] == pytest.approx(2.0)
    assert saved["learning"]["variants"]["sync_colocated"]["time_to_reward_median_s"] == pytest.approx(4.0)
    assert saved["ratio_ci"]["dora_s3/sync_throughput"]["pairs"] == 2 == result["ratio_ci"]["dora_s3/sync_throughput"]["pairs"]
    assert (tmp_path / "reward_curves.png").stat().st_size > 0
    assert "Time to a trailing 2-step mean reward of 0.500" in (tmp_path / "bench.md").read_text()
