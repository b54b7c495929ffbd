"""`dora bench` planning and aggregation (the runs themselves are integration work)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.launch.bench import VARIANTS, aggregate, markdown_table, split_cores, variant_config

ROOT = Path(__file__).resolve().parents[3]


def test_split_cores_disjoint_and_complete():
    for n in (2, 4, 8, 16):
        engines, trainer = split_cores(n, 2)
        assert engines and trainer and not set(engines) & set(trainer)
        assert sorted(engines + trainer) == list(range(n))
    assert split_cores(1, 2) == ([0], [0])


def test_variant_configs_share_model_and_prompts(tmp_path):
    # two cap phases in the base, so that the one-cap ablation has something to change
    base = load_config(ROOT / "configs" / "bench" / "cpu_longtail.yaml", ["orchestrator.cap_after_rebalance=12"])
    cfgs = {name: variant_config(base, name, 0, tmp_path / name, tmp_path / "model", 2)
            for name in ("sync_colocated", "sync", "one_step_off", "partial", "dora_s1", "dora_s3",
                         "dora_reprefill", "dora_legacy_fill", "dora_one_cap")}
    assert {c.model.path for c in cfgs.values()} == {str(tmp_path / "model")}
    assert {c.data.seed for c in cfgs.values()} == {base.data.seed}
    assert {c.run.steps for c in cfgs.values()} == {base.run.steps}
    colo = cfgs["sync_colocated"]
    # colocated: no pinning; the 2 engines split the 2 cores during rollout, the trainer takes both
    assert colo.launch.engine_cpus == [] and colo.launch.trainer_cpus == []
    assert colo.rollout.threads_per_instance == 1 and colo.launch.trainer_threads == 2
    wide = variant_config(base, "sync_colocated", 0, tmp_path / "w", tmp_path / "model", 8)
    assert wide.rollout.threads_per_instance == 4 and wide.launch.trainer_threads == 8
    assert cfgs["sync"].launch.engine_cpus == [0] and cfgs["sync"].launch.trainer_cpus == [1]
    assert cfgs["dora_s3"].orchestrator.max_staleness == 3 and cfgs["dora_s1"].orchestrator.max_staleness == 1
    assert cfgs["dora_reprefill"].controller.migration == "reprefill"
    assert cfgs["dora_one_cap"].orchestrator.cap_after_rebalance == base.orchestrator.cap_before_rebalance != 12
    assert cfgs["partial"].orchestrator.mode == "partial" and cfgs["dora_legacy_fill"].orchestrator.legacy_fill


def test_aggregate_picks_faster_sync_and_ratios():
    runs = {
        "sync": [{"throughput_tokens_per_s": 100.0, "mean_step_time_s": 4.0}],
        "sync_colocated": [{"throughput_tokens_per_s": 120.0, "mean_step_time_s": 3.0}],
        "partial": [{"throughput_tokens_per_s": 150.0, "mean_step_time_s": 2.5}],
        "dora_s1": [{"throughput_tokens_per_s": 240.0, "mean_step_time_s": 1.5},
                    {"throughput_tokens_per_s": 260.0, "mean_step_time_s": 1.5}],
    }
    agg = aggregate(runs)
    assert agg["ratios"]["sync_baseline"] == "sync_colocated"
    assert agg["ratios"]["dora_s1/sync_throughput"] == pytest.approx(250 / 120)
    assert agg["ratios"]["dora_s1/sync_step_time_speedup"] == pytest.approx(3.0 / 1.5)
    assert agg["ratios"]["dora_s1/partial_throughput"] == pytest.approx(250 / 150)
    assert "dora_s1/one_step_off_throughput" not in agg["ratios"]
    table = markdown_table(agg)
    assert "| dora_s1 | 250 (240-260) |" in table and "sync_colocated" in table


def test_every_variant_is_documented():
    from dora_megatron.config.bench import VARIANT_NAMES

    assert set(VARIANTS) == set(VARIANT_NAMES)


def test_seed_mean_curves_and_smoothing(tmp_path):
    import json

    from dora_megatron.launch.bench import _smooth, seed_mean_curves

    for k, rewards in enumerate(([0.0, 1.0, 0.5], [1.0, 0.0, 0.5, 0.9])):  # the second seed ran one step more
        d = tmp_path / f"s{k}"
        d.mkdir()
        d.joinpath("steps.jsonl").write_text("".join(
            json.dumps({"step": i, "reward/mean": r, "perf/step_time_s": 2.0 * (k + 1)}) + "\n" for i, r in enumerate(rewards)))
    steps, rewards, walls = seed_mean_curves([tmp_path / "s0", tmp_path / "s1"])
    assert steps == [0, 1, 2]  # only steps every seed reached
    assert rewards == [0.5, 0.5, 0.5]
    assert walls == [3.0, 6.0, 9.0]  # mean of the seeds' cumulative step times
    assert _smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert seed_mean_curves([tmp_path / "missing"]) == ([], [], [])


def test_run_order_is_seed_major_with_the_limits_first():
    from dora_megatron.launch.bench import run_order

    assert run_order(["sync", "dora_s3"], 2, limits=True) == [
        (0, "limits"), (0, "sync"), (0, "dora_s3"), (1, "limits"), (1, "sync"), (1, "dora_s3")]
    assert run_order(["sync", "dora_s3"], 2, limits=False) == [(0, "sync"), (0, "dora_s3"), (1, "sync"), (1, "dora_s3")]


def test_efficiency_pairs_each_run_with_the_bound_of_its_round():
    limits = [{"rollout_tokens_per_s": 100.0, "training_tokens_per_s": 200.0},  # round 0: bound 100
              {"rollout_tokens_per_s": 100.0, "training_tokens_per_s": 50.0}]  # round 1 (a busy machine): bound 50
    runs = {"sync": [{"throughput_tokens_per_s": 40.0, "mean_step_time_s": 4.0},
                     {"throughput_tokens_per_s": 20.0, "mean_step_time_s": 8.0}],
            "dora_s3": [{"throughput_tokens_per_s": 90.0, "mean_step_time_s": 2.0},
                        {"throughput_tokens_per_s": 50.0, "mean_step_time_s": 3.0}]}
    agg = aggregate(runs, limits=limits)
    d = agg["means"]["dora_s3"]
    assert (d["efficiency"], d["efficiency_min"], d["efficiency_max"]) == pytest.approx((0.95, 0.9, 1.0))
    assert (d["throughput_median"], d["throughput_min"], d["throughput_max"]) == (70.0, 50.0, 90.0)
    assert agg["means"]["sync"]["efficiency"] == pytest.approx(0.4)
    lim = agg["limits"]
    assert lim["bound_tokens_per_s"] == 75.0 and (lim["bound_min"], lim["bound_max"]) == (50.0, 100.0)
    assert lim["rollout_tokens_per_s"] == 100.0 and lim["training_tokens_per_s"] == 125.0
    assert lim["bound_by"] == "rollout"
    table = markdown_table(agg)
    assert "| dora_s3 | 70 (50-90) | 57% | 0.95 (0.90-1.00) | 2.33 |" in table
    assert "bound min(the two) 75 (rollout-bound)" in table
    # without limits there is no efficiency, and the table says so
    plain = aggregate(runs)
    assert plain["means"]["dora_s3"]["efficiency"] is None and "limits" not in plain
    assert "| n/a (n/a-n/a) |" in markdown_table(plain)


def test_ratios_use_the_median_so_one_slow_seed_does_not_decide():
    runs = {"sync": [{"throughput_tokens_per_s": 100.0}] * 3,
            "dora_s3": [{"throughput_tokens_per_s": 150.0}, {"throughput_tokens_per_s": 150.0},
                        {"throughput_tokens_per_s": 15.0}]}  # one seed on a machine under load
    assert aggregate(runs)["ratios"]["dora_s3/sync_throughput"] == pytest.approx(1.5)


def test_limit_steps_must_leave_a_measured_step(tmp_path):
    from dora_megatron.config.base import ConfigError

    with pytest.raises(ConfigError, match="bench.limit_steps"):
        load_config(ROOT / "configs" / "bench" / "cpu_longtail.yaml", ["bench.limit_steps=1"])


def test_the_bench_overview_puts_each_variants_run_overview_side_by_side(tmp_path):
    import json

    import matplotlib.image as mpimg
    import numpy as np

    from dora_megatron.launch.bench import plot_overviews

    drawn, given, empty = tmp_path / "dora-seed0", tmp_path / "sync-seed0", tmp_path / "partial-seed0"
    for d in (drawn, given, empty):
        d.mkdir()
    drawn.joinpath("steps.jsonl").write_text("".join(  # no overview.png: drawn from its steps
        json.dumps({"step": i, "reward/mean": 0.1 * i, "perf/step_time_s": 1.0}) + "\n" for i in range(3)))
    mpimg.imsave(given / "overview.png", np.zeros((75, 150, 3)))  # the run's own, used as it is
    out = plot_overviews({"sync": [given], "dora": [drawn], "partial": [empty]}, tmp_path / "overview.png")
    assert out == tmp_path / "overview.png" and (drawn / "overview.png").is_file()
    h, w = mpimg.imread(out).shape[:2]
    assert w > 1.5 * h  # two overviews side by side (the empty run has none)
    assert plot_overviews({"partial": [empty]}, tmp_path / "none.png") is None


def test_eval_reward_source_needs_the_eval_set_and_rounds_during_the_run():
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.loader import apply_overrides, from_dict, read_yaml, validate
    from dora_megatron.config.schema import DoraConfig

    base = read_yaml("configs/bench/cpu_longtail.yaml")
    for overrides, named in ((["bench.reward_source=eval"], "data.eval_path"),
                             (["bench.reward_source=eval", "data.eval_path=configs/bench/digit_cipher_eval.jsonl"],
                              "observability.eval_interval")):
        with pytest.raises(ConfigError, match="bench.reward_source") as err:
            validate(from_dict(DoraConfig, apply_overrides(dict(base), overrides)))
        assert named in str(err.value)
    validate(from_dict(DoraConfig, apply_overrides(dict(base), [
        "bench.reward_source=eval", "data.eval_path=configs/bench/digit_cipher_eval.jsonl",
        "observability.eval_interval=5"])))


def test_the_committed_digit_eval_set_is_the_held_out_prompts_scored_by_the_task(tmp_path):
    """configs/bench/digit_cipher_eval.jsonl is what tools/make_digit_eval_set.py writes for the
    bench config, reads as an eval set, and each ground truth earns the task's full reward."""
    import importlib.util

    from dora_megatron.config.loader import apply_overrides, from_dict, read_yaml
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.data import sources
    from dora_megatron.data.tasks import make_prompt_source

    spec = importlib.util.spec_from_file_location("make_digit_eval_set", "tools/make_digit_eval_set.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "eval.jsonl"
    assert tool.main(["--config", "configs/bench/cpu_longtail.yaml", "--prompts", "32", "--out", str(out)]) == 0
    assert out.read_text() == open("configs/bench/digit_cipher_eval.jsonl").read()
    cfg = from_dict(DoraConfig, apply_overrides(read_yaml("configs/bench/cpu_longtail.yaml"), [f"data.eval_path={out}"]))
    rows = sources.eval_prompts(cfg, sources.job_codec(cfg, None))
    _, reward = make_prompt_source(cfg.data.task, min_len=1, max_len=4)
    assert len(rows) == 32 and all(reward(p.answer, p.answer) == 1.0 for p in rows)
    assert sum(reward("", p.answer) for p in rows) == 0.0


def test_engines_run_every_variant_on_each_engine_in_the_same_round():
    from dora_megatron.launch.bench import run_order

    order = run_order(["sync", "dora_s3", "dora_s3_reprefill@embedded"], 2, limits=False, engines=["embedded", "sglang"])
    assert order[:5] == [(0, "sync@embedded"), (0, "dora_s3@embedded"), (0, "dora_s3_reprefill@embedded"),
                         (0, "sync@sglang"), (0, "dora_s3@sglang")]
    assert order[5:] == [(1, n) for _, n in order[:5]]  # round 1 repeats round 0: seed-major
    # limits are measured per engine (its own capacities), at the head of that engine's runs
    assert run_order(["sync"], 1, limits=True, engines=["embedded", "sglang"]) == [
        (0, "limits@embedded"), (0, "sync@embedded"), (0, "limits@sglang"), (0, "sync@sglang")]


def test_a_variant_at_an_engine_starts_that_engine_with_its_own_section(tmp_path):
    base = load_config(ROOT / "configs" / "bench" / "cpu_sglang.yaml")
    assert base.rollout.engine == "sglang" and base.bench.engines == ["embedded", "sglang"]
    emb = variant_config(base, "dora_s3@embedded", 0, tmp_path / "e", tmp_path / "model", 2)
    sgl = variant_config(base, "sync@sglang", 0, tmp_path / "s", tmp_path / "model", 2)
    assert emb.rollout.engine == "embedded" and emb.orchestrator.max_staleness == 3
    assert sgl.rollout.engine == "sglang" and sgl.orchestrator.mode == "sync"
    assert sgl.sglang.python == base.sglang.python and sgl.launch.engine_cpus == [0]
    kvless = variant_config(base, "dora_s3_reprefill@embedded", 0, tmp_path / "r", tmp_path / "model", 2)
    assert kvless.controller.migration == "reprefill" and kvless.rollout.engine == "embedded"


def test_bench_engines_and_engine_suffixes_are_checked():
    from dora_megatron.config.base import ConfigError

    cfg = ROOT / "configs" / "bench" / "cpu_sglang.yaml"
    with pytest.raises(ConfigError, match=r"bench.engines\[1\].*'sglng'"):
        load_config(cfg, ['bench.engines=["embedded", "sglng"]'])
    with pytest.raises(ConfigError, match=r"bench.variants\[0\].*vllm"):
        load_config(cfg, ['bench.variants=["sync@vllm"]'])  # an engine the bench does not run
    with pytest.raises(ConfigError, match="twice"):
        load_config(cfg, ['bench.engines=["sglang", "sglang"]'])


def test_engines_get_their_own_baseline_and_a_paired_ratio_against_the_first():
    from dora_megatron.launch.bench import aggregate_engines, engines_markdown

    runs = {"sync@embedded": [{"throughput_tokens_per_s": 100.0}, {"throughput_tokens_per_s": 50.0}],
            "dora_s3@embedded": [{"throughput_tokens_per_s": 200.0}, {"throughput_tokens_per_s": 100.0}],
            "sync@sglang": [{"throughput_tokens_per_s": 50.0}, {"throughput_tokens_per_s": 25.0}],
            "dora_s3@sglang": [{"throughput_tokens_per_s": 150.0}, {"throughput_tokens_per_s": 75.0}]}
    agg = aggregate_engines(runs, ["embedded", "sglang"], "auto", {}, 0.95)
    # each engine's DORA against its own sync: 2x on embedded, 3x on sglang
    assert agg["engines"]["embedded"]["ratios"]["dora_s3/sync_throughput"] == pytest.approx(2.0)
    assert agg["engines"]["sglang"]["ratios"]["dora_s3/sync_throughput"] == pytest.approx(3.0)
    cross = agg["engine_ratio_ci"]
    assert set(cross) == {"sync@sglang/sync@embedded_throughput", "dora_s3@sglang/dora_s3@embedded_throughput"}
    # round 1 ran at half speed on both engines: pairing by round leaves no spread
    assert cross["dora_s3@sglang/dora_s3@embedded_throughput"]["ratio"] == pytest.approx(0.75)
    assert cross["dora_s3@sglang/dora_s3@embedded_throughput"]["lo"] == pytest.approx(0.75)
    md = engines_markdown(agg)
    assert "### Engine `sglang`" in md and "`sync@sglang/sync@embedded_throughput`: 0.50x" in md


def test_reprefill_costs_count_resubmits_and_time_against_the_kv_pair_on_the_same_engine():
    from dora_megatron.launch.bench import reprefill_costs, reprefill_table

    kv = [{"throughput_tokens_per_s": 200.0, "mean_step_time_s": 2.0, "migrations": 6, "migrations_reprefill": 0,
           "reprefill_tokens": 0, "migration_stall_s": 0.1}] * 2
    resub = [{"throughput_tokens_per_s": 160.0, "mean_step_time_s": 2.5, "migrations": 5, "migrations_reprefill": 4,
              "reprefill_tokens": 300, "migration_stall_s": 0.4},
             {"throughput_tokens_per_s": 180.0, "mean_step_time_s": 2.5, "migrations": 7, "migrations_reprefill": 6,
              "reprefill_tokens": 500, "migration_stall_s": 0.6}]
    runs = {"sync@embedded": [{"throughput_tokens_per_s": 100.0, "migrations": 0}] * 2,
            "dora_s3@embedded": kv, "dora_s3_reprefill@embedded": resub,
            "dora_s3@sglang": resub}  # SGLang resubmits every move, and has no KV run to pair with
    costs = reprefill_costs(runs)
    assert "sync@embedded" not in costs  # nothing moved
    r = costs["dora_s3_reprefill@embedded"]
    assert (r["migrations_reprefill"], r["reprefill_tokens"], r["tokens_per_reprefill"]) == (5.0, 400.0, 80.0)
    assert r["migration_stall_s"] == pytest.approx(0.5)
    assert r["kv_reference"] == "dora_s3@embedded" and r["step_time_cost_s"] == pytest.approx(0.5)
    assert r["vs_kv"]["ratio"] == pytest.approx((0.8 * 0.9) ** 0.5) and r["vs_kv"]["pairs"] == 2
    s = costs["dora_s3@sglang"]
    assert s["reprefill_tokens"] == 400.0 and s["kv_reference"] is None and s["step_time_cost_s"] is None
    assert costs["dora_s3@embedded"]["migrations_reprefill"] == 0 and costs["dora_s3@embedded"]["tokens_per_reprefill"] is None
    table = reprefill_table(costs)
    assert "| dora_s3_reprefill@embedded | 6.0 | 5.0 | 400 | 80 | 0.50 | 0.50 |" in table
    assert reprefill_table({}) == ""
