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


def test_uneven_pipeline_splits_are_refused_naming_the_field():
    """Megatron's fields for an uneven layer split are real (Megatron would build 1 + 3 layers), but
    the trainer maps the Hugging Face layers onto evenly split stages, so a stage would load another
    stage's layers: refused before the job starts, and by the trainer itself."""
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.models.hf_config import spec_from_dict
    from dora_megatron.models.presets import preset_config
    from dora_megatron.trainer.model import build_transformer_config

    problem = trainer_layout_problem(load_config(None, ["trainer.pp=2", "launch.trainer_procs=2",
                                                        "trainer.megatron.num_layers_in_first_pipeline_stage=1"]))
    assert problem and "trainer.megatron.num_layers_in_first_pipeline_stage: uneven pipeline splits" in problem
    arch = spec_from_dict(preset_config("tiny-moe"))
    with pytest.raises(ValueError, match="trainer.megatron.num_layers_in_last_pipeline_stage: uneven"):
        build_transformer_config(arch, TrainerConfig(pp=2, megatron={"num_layers_in_last_pipeline_stage": 3}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=4 not divisible by trainer.pp \* trainer.vpp = 3"):
        build_transformer_config(arch, TrainerConfig(pp=3))


def test_dry_run_prints_the_memory_estimate(tmp_path, capsys):
    assert cli.main(["train", "--dry-run", "--set", "trainer.device=cuda", "--set", "rollout.device=cuda",
                     "--set", "cluster.gpu_memory_gb=16"]) == 0
    out = capsys.readouterr().out
    assert "trainer memory estimate per rank" in out and "cluster.gpu_memory_gb 16 GiB: fits" in out
    # a layout that cannot fit is refused before anything starts
    assert cli.main(["train", "--dry-run", "--set", "trainer.device=cuda", "--set", "rollout.device=cuda",
                     "--set", "cluster.gpu_memory_gb=1", "--set", "trainer.max_seq_len=65536"]) == 2
    assert "cluster.gpu_memory_gb=1: the trainer needs an estimated" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [
    # YaRN on a grouped-query model: the trainer builds YarnTransformerConfig (its yarn_* fields)
    {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
     "head_dim": 16, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                         "original_max_position_embeddings": 64}},
    # multi-latent attention: MLATransformerConfig (q_lora_rank, kv_lora_rank, ...)
    {"model_type": "deepseek_v3", "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32,
     "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16,
     "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rms_norm_eps": 1e-6,
     "rope_theta": 1e4}])
def test_megatron_values_are_checked_on_the_config_class_the_trainer_builds(tmp_path, extra):
    """``trainer.megatron`` values are tried on the family's own Megatron config class: the YaRN and
    MLA fields are not TransformerConfig's, and a check on it refused every such model."""
    import json

    config = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 128, "max_position_embeddings": 256,
              "tie_word_embeddings": False, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config(None, [f"model.path={tmp_path}", "trainer.megatron.moe_router_fusion=false"])
    assert trainer_layout_problem(cfg) is None
    bad = trainer_layout_problem(load_config(None, [f"model.path={tmp_path}", "trainer.recompute=selective",
                                                    "trainer.megatron.recompute_modules=[warp_drive]"]))
    assert "Megatron's TransformerConfig refuses" in bad and "warp_drive" in bad
