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


def test_an_uneven_pipeline_split_passes_and_moves_the_memory_estimate():
    """``num_layers_in_first_pipeline_stage: 1`` of the 4-layer preset on 2 stages (1 + 3 layers) is
    taken before the job starts, and the estimated first-stage rank holds 1 layer, not the even 2."""
    from dora_megatron.launch.layout import memory_estimate

    even = load_config(None, ["trainer.pp=2", "launch.trainer_procs=2"])
    uneven = load_config(None, ["trainer.pp=2", "launch.trainer_procs=2",
                                "trainer.megatron.num_layers_in_first_pipeline_stage=1"])
    assert trainer_layout_problem(uneven) is None
    # 3 layers of 4 on 2 stages: only an uneven split holds them
    three = ["trainer.pp=2", "launch.trainer_procs=2", "trainer.megatron.num_layers_in_last_pipeline_stage=1"]
    assert trainer_layout_problem(load_config(None, three)) is None
    est_even, est_uneven = memory_estimate(even), memory_estimate(uneven)
    assert est_uneven.params < est_even.params and est_uneven.activations < est_even.activations


@pytest.mark.parametrize("overrides,words", [
    # the first stage takes every layer and more: Megatron leaves the last stage -1 layers
    (["trainer.megatron.num_layers_in_first_pipeline_stage=5"],
     "trainer.megatron.num_layers_in_first_pipeline_stage=5: pipeline rank 1 would hold -1 transformer layers"),
    # Megatron's own refusal: no layers left for the middle stage
    (["trainer.pp=3", "launch.trainer_procs=3", "trainer.megatron.num_layers_in_first_pipeline_stage=2",
      "trainer.megatron.num_layers_in_last_pipeline_stage=2"],
     "trainer.megatron.num_layers_in_last_pipeline_stage=2: Megatron's TransformerConfig refuses the configuration: Mismatch"),
    # a stage of only the loss (Megatron's standalone loss stage)
    (["trainer.pp=3", "launch.trainer_procs=3", "trainer.megatron.pipeline_model_parallel_layout=Et|ttt|L"],
     "pipeline_model_parallel_layout='Et|ttt|L': pipeline rank 2 would hold 0 transformer layers"),
    # a layout of 2 chunks per rank where trainer.vpp is 1
    (["trainer.megatron.pipeline_model_parallel_layout=Et|t|t|tL"], "2 model chunks per pipeline rank, but trainer.vpp=1"),
    (["trainer.vpp=2", "trainer.megatron.pipeline_model_parallel_layout=Et|t|t|tL"],
     "virtual stages) in a custom layout are not supported"),
    # the uneven first stage's layers must split into the virtual stages
    (["trainer.vpp=2", "trainer.megatron.num_layers_in_first_pipeline_stage=1"],
     "num_layers_in_first_pipeline_stage=1: Megatron's TransformerConfig refuses the configuration: number of layers at "
     "first stage: 1"),
])
def test_impossible_uneven_splits_are_refused_naming_the_field(overrides, words):
    base = [] if any(o.startswith("trainer.pp=") for o in overrides) else ["trainer.pp=2", "launch.trainer_procs=2"]
    problem = trainer_layout_problem(load_config(None, base + overrides))
    assert problem and words in problem


def test_the_trainer_refuses_an_impossible_split_and_an_even_one_that_does_not_divide():
    """The same rules on the ranks (``build_transformer_config``), where no pre-flight ran."""
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.models.hf_config import spec_from_dict
    from dora_megatron.models.presets import preset_config
    from dora_megatron.trainer.model import build_transformer_config

    arch = spec_from_dict(preset_config("tiny-moe"))
    with pytest.raises(ValueError, match=r"num_layers_in_last_pipeline_stage=5: pipeline rank 0 would hold -1"):
        build_transformer_config(arch, TrainerConfig(pp=2, megatron={"num_layers_in_last_pipeline_stage": 5}))
    with pytest.raises(ValueError, match=r"num_layers_in_last_pipeline_stage=4: Megatron's TransformerConfig refuses "
                                         r"the configuration: Mismatch: 0 middle layers"):
        build_transformer_config(arch, TrainerConfig(pp=2, megatron={"num_layers_in_last_pipeline_stage": 4}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=4 not divisible by trainer.pp \* trainer.vpp = 3"):
        build_transformer_config(arch, TrainerConfig(pp=3))
    # 1 + 3 layers on 2 stages is built
    assert build_transformer_config(arch, TrainerConfig(pp=2, megatron={"num_layers_in_last_pipeline_stage": 3}))


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
