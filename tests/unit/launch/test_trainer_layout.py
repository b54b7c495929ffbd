"""Trainer knobs that need the model's shape are refused before anything starts (``dora train``,
also ``--dry-run``), and the dry run prints the per-rank memory estimate."""

from __future__ import annotations

import pytest

from dora_megatron.cli import main as cli
from dora_megatron.config.schema import load_config
from dora_megatron.launch.layout import trainer_layout_problem


@pytest.mark.parametrize("overrides,words", [
    (["trainer.pp=2", "trainer.vpp=4", "launch.trainer_procs=2"], "trainer.vpp=4: the model's 4 layers cannot"),
    (["trainer.etp=1", "model.preset=tiny-dense"], "trainer.etp=1 applies to MoE experts"),
    (["trainer.recompute=full", "trainer.recompute_num_layers=3"], "recompute_method uniform splits the 4 layers"),
    (["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_num_layers=5"],
     "recomputes at most the 4 layers"),
])
def test_shape_rules_name_the_key(overrides, words):
    problem = trainer_layout_problem(load_config(None, overrides))
    assert problem and words in problem


def test_fitting_knobs_pass():
    cfg = load_config(None, ["trainer.pp=2", "trainer.vpp=2", "launch.trainer_procs=2", "trainer.recompute=full",
                             "trainer.recompute_num_layers=1"])
    assert trainer_layout_problem(cfg) is None


def test_megatron_field_names_and_values_are_checked_by_megatron():
    bad_name = trainer_layout_problem(load_config(None, ["trainer.megatron.recompute_modulez=[core_attn]"]))
    assert "trainer.megatron.recompute_modulez" in bad_name and "did you mean 'recompute_modules'" in bad_name
    # a real field with a value Megatron's own __post_init__ refuses
    bad_value = trainer_layout_problem(load_config(None, ["trainer.recompute=selective",
                                                          "trainer.megatron.recompute_modules=[warp_drive]"]))
    assert "Megatron's TransformerConfig refuses" in bad_value and "warp_drive" in bad_value
    assert trainer_layout_problem(load_config(None, ["trainer.megatron.moe_router_fusion=false"])) is None


def test_dry_run_prints_the_memory_estimate(tmp_path, capsys):
    assert cli.main(["train", "--dry-run", "--set", "trainer.device=cuda", "--set", "rollout.device=cuda",
                     "--set", "cluster.gpu_memory_gb=16"]) == 0
    out = capsys.readouterr().out
    assert "trainer memory estimate per rank" in out and "cluster.gpu_memory_gb 16 GiB: fits" in out
    # a layout that cannot fit is refused before anything starts
    assert cli.main(["train", "--dry-run", "--set", "trainer.device=cuda", "--set", "rollout.device=cuda",
                     "--set", "cluster.gpu_memory_gb=1", "--set", "trainer.max_seq_len=65536"]) == 2
    assert "cluster.gpu_memory_gb=1: the trainer needs an estimated" in capsys.readouterr().err
