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
    base = load_config(ROOT / "configs" / "bench" / "cpu_longtail.yaml")
    cfgs = {name: variant_config(base, name, 0, tmp_path / name, tmp_path / "model", 2)
            for name in ("sync_colocated", "sync", "one_step_off", "partial", "dora_s1", "dora_s3",
                         "dora_reprefill", "dora_legacy_fill", "dora_one_cap")}
    assert {c.model.path for c in cfgs.values()} == {str(tmp_path / "model")}
    assert {c.data.seed for c in cfgs.values()} == {base.data.seed}
    assert {c.run.steps for c in cfgs.values()} == {base.run.steps}
    assert cfgs["sync_colocated"].launch.engine_cpus == [] and cfgs["sync_colocated"].rollout.threads_per_instance == 2
    assert cfgs["sync"].launch.engine_cpus == [0] and cfgs["sync"].launch.trainer_cpus == [1]
    assert cfgs["dora_s3"].orchestrator.max_staleness == 3 and cfgs["dora_s1"].orchestrator.max_staleness == 1
    assert cfgs["dora_reprefill"].controller.migration == "reprefill"
    assert cfgs["dora_one_cap"].orchestrator.cap_after_rebalance == base.orchestrator.cap_before_rebalance
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
    assert "| dora_s1 | 250 |" in table and "sync_colocated" in table


def test_every_variant_is_documented():
    from dora_megatron.config.bench import VARIANT_NAMES

    assert set(VARIANTS) == set(VARIANT_NAMES)
