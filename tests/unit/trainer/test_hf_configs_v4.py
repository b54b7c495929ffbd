"""Configs saved by transformers 4.x (hand-written in ``tests/helpers/hf_configs_v4``, one per
family, spelled as the Hub's checkpoints of that era are): every reader (the trainer, the embedded
engine's checks) reads each as the model transformers 4.x built, and the trainer builds its
Megatron config from it.

The spellings that differ from what 5.x writes: ``rope_theta`` on the config and ``rope_scaling``
(``null``, or YaRN keyed by ``type``), ``torch_dtype``, GLM-4.5's top-level
``partial_rotary_factor``, Qwen1.5-MoE's ``sliding_window`` kept with ``use_sliding_window: false``,
a Qwen2-MoE without ``qkv_bias`` (always on in 4.x), DeepSeek-V3's remote-code keys (``auto_map``,
``topk_method``, ``scoring_func``, ``ep_size``)."""

from __future__ import annotations

import pytest

from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.models.hf_config import spec_from_dict
from dora_megatron.trainer.model import arch_from_hf_config, build_transformer_config
from tests.helpers.hf_dirs import v4_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_reader_accepts_the_4x_config(family):
    cfg = v4_config(family)
    assert "rope_parameters" not in cfg and "rope_theta" in cfg and "torch_dtype" in cfg  # the 4.x spelling
    spec = spec_from_dict(cfg)
    assert spec.engine_problems() == [] and spec.trainer_problems() == []
    assert spec.rope_theta == float(cfg["rope_theta"]) and spec.dtype == cfg["torch_dtype"]
    config = build_transformer_config(arch_from_hf_config(cfg), TrainerConfig())
    assert config.num_layers == cfg["num_hidden_layers"]


def test_4x_spellings_mean_what_they_meant_to_transformers_4x():
    # YaRN keyed by "type" (Qwen3's long-context recipe; DeepSeek-V3's rope_scaling) is YaRN, with its values
    qwen3_moe = spec_from_dict(v4_config("qwen3_moe"))
    assert qwen3_moe.rope_type == "yarn" and (qwen3_moe.yarn.factor, qwen3_moe.yarn.original_max_position_embeddings) == (4.0, 64)
    assert build_transformer_config(qwen3_moe, TrainerConfig()).yarn_rotary_scaling_factor == 4.0
    deepseek = spec_from_dict(v4_config("deepseek_v3"))
    assert deepseek.rope_type == "yarn" and deepseek.yarn.mscale_pair and deepseek.mtp_layers == 1
    mla = build_transformer_config(deepseek, TrainerConfig())
    assert (mla.rope_type, mla.rotary_scaling_factor, mla.mscale_all_dim) == ("yarn", 4.0, 1.0)
    assert deepseek.router == "sigmoid" and deepseek.router_groups == 2 and deepseek.routed_scaling_factor == 2.5
    # Qwen1.5-MoE: sliding_window is set but use_sliding_window false: no layer slides (a reader that
    # took sliding_window alone would refuse the model); q/k/v biases with no qkv_bias key
    qwen2 = spec_from_dict(v4_config("qwen2_moe"))
    assert qwen2.sliding_window_layers == () and qwen2.qkv_bias and qwen2.shared_expert_gate
    # GLM-4.5's partial_rotary_factor on the config (5.x: in rope_parameters); use_qk_norm false
    glm = spec_from_dict(v4_config("glm4_moe"))
    assert glm.rotary_dim == 8 and not glm.qk_norm and glm.qkv_bias and glm.sparse_layers == (1,)
    assert glm.eos_token_ids == (1, 2)
    mixtral = spec_from_dict(v4_config("mixtral"))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 32, True)
    assert spec_from_dict(v4_config("qwen3")).tie_word_embeddings


@pytest.mark.parametrize("family,patch,match", [
    # the same 4.x keys, switched on: what the trainer cannot build is named, not misread
    ("qwen2_moe", {"use_sliding_window": True}, "sliding-window attention"),
    ("qwen3_moe", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                                      "mscale_all_dim": 1.0}}, "mscale_all_dim without rope_parameters.mscale"),
])
def test_4x_keys_the_trainer_cannot_build_are_named(family, patch, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config({**v4_config(family), **patch})
