import pytest
import torch

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.base import ConfigError
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.trainer.model import arch_from_hf_config, choose_spec, padded_vocab_size

MOE = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": False,
       "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
       "tie_word_embeddings": True, "mlp_only_layers": [], "decoder_sparse_step": 1}


def test_moe_config_fields():
    a = arch_from_hf_config(MOE)
    assert (a.num_experts, a.top_k, a.moe_intermediate_size, a.head_dim, a.num_kv_heads) == (8, 2, 96, 32, 2)
    assert a.rope_theta == 1e6 and a.tie_word_embeddings and not a.norm_topk_prob and a.is_moe


def test_dense_defaults_and_legacy_rope_theta():
    """Omitted keys mean what they mean to transformers: Qwen3's head_dim defaults to 128 (not
    hidden / heads = 16), so the weights' shapes and RoPE follow the model transformers builds."""
    cfg = {k: v for k, v in MOE.items() if k not in ("num_experts", "rope_parameters", "head_dim")}
    cfg.update(model_type="qwen3", rope_theta=5000.0)
    a = arch_from_hf_config(cfg)
    assert not a.is_moe and a.rope_theta == 5000.0 and a.head_dim == 128


@pytest.mark.parametrize("patch,match", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"model_type": "gpt2"}, "supported: qwen3, qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0, "factor": 2.0}},
     r"rope_type 'linear' is not supported by the Megatron trainer \(supported: default, yarn\)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0, "attention_factor": 1.5,
                          "original_max_position_embeddings": 1024}}, "rope_parameters.attention_factor=1.5")])
def test_unsupported_configs_are_rejected(patch, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config({**MOE, **patch})


def test_family_fields_come_from_each_familys_config_keys():
    """Mixtral's expert width is intermediate_size and it always renormalises; Qwen2-MoE has q/k/v
    biases (on when its config omits qkv_bias, as transformers 4.x configs do), no QK-norm and a
    gated shared expert; a Qwen3-MoE's mlp_only_layers are dense."""
    base = {k: v for k, v in MOE.items() if k not in ("num_experts", "mlp_only_layers", "decoder_sparse_step",
                                                      "moe_intermediate_size", "norm_topk_prob", "head_dim")}
    mixtral = arch_from_hf_config({**base, "model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 48})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 48, True)
    assert mixtral.moe_module == "block_sparse_moe" and mixtral.expert_proj == ("w1", "w3", "w2")
    assert not mixtral.qk_norm and not mixtral.qkv_bias and mixtral.sparse_layers == (0, 1)
    qwen2 = arch_from_hf_config({**base, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 24,
                                 "shared_expert_intermediate_size": 40})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm and not qwen2.norm_topk_prob
    assert (qwen2.shared_expert_intermediate_size, qwen2.shared_expert_gate, qwen2.moe_intermediate_size) == (40, True, 24)
    assert arch_from_hf_config({**MOE, "mlp_only_layers": [0]}).sparse_layers == (1,)


DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 8,
            "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1,
            "first_k_dense_replace": 2, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 6, "routed_scaling_factor": 2.5, "rope_theta": 1e4}


def test_deepseek_v3_fields():
    """DeepSeek-V3's MLA ranks and head widths, its n_shared_experts * moe_intermediate_size shared
    expert, group-limited sigmoid routing and first_k_dense_replace dense layers."""
    a = arch_from_hf_config(DEEPSEEK)
    assert a.is_mla and (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (
        16, 8, 8, 4, 6)
    assert (a.num_experts, a.shared_expert_intermediate_size, a.shared_expert_module) == (8, 16, "shared_experts")
    assert (a.router, a.router_groups, a.router_group_topk, a.routed_scaling_factor, a.norm_topk_prob) == (
        "sigmoid", 4, 1, 2.5, True)
    assert a.sparse_layers == (2,) and a.router_expert_bias
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in a.expected_shapes()
    assert arch_from_hf_config({**DEEPSEEK, "q_lora_rank": None}).expected_shapes()[
        "model.layers.0.self_attn.q_proj.weight"] == (4 * 12, 32)


@pytest.mark.parametrize("patch,match", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"num_experts_per_tok": 4, "topk_group": 1}, "topk_group=1"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'linear'")])
def test_deepseek_v3_what_megatron_computes_differently_is_refused(patch, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config({**DEEPSEEK, **patch})


def test_spec_choice_and_vocab_padding():
    """auto is TE only on CUDA with TE importable and a model the TE spec builds: DeepSeek-V3's MLA
    and an MoE with dense layers (first_k_dense_replace, mlp_only_layers) get the local spec."""
    moe, mla = arch_from_hf_config(MOE), arch_from_hf_config(DEEPSEEK)
    moe_dense_layer = arch_from_hf_config({**MOE, "mlp_only_layers": [0]})
    assert choose_spec("auto", "cuda", moe, te_importable=True) == "te"
    assert choose_spec("auto", "cuda", moe, te_importable=False) == "local"
    assert choose_spec("auto", "cpu", moe, te_importable=True) == "local"
    assert choose_spec("auto", "cuda", mla, te_importable=True) == "local"
    assert choose_spec("auto", "cuda", moe_dense_layer, te_importable=True) == "local"
    assert choose_spec("te", "cuda", moe, te_importable=False) == "te"  # explicit: kept, fails where it builds
    assert choose_spec("local", "cuda", moe, te_importable=True) == "local"
    assert padded_vocab_size(10, 4) == 12 and padded_vocab_size(128, 2) == 128


def test_explicit_te_spec_names_what_it_cannot_build():
    from dora_megatron.trainer.model import build_layer_spec, build_transformer_config

    mla = arch_from_hf_config(DEEPSEEK)
    with pytest.raises(ValueError, match=r"trainer.spec: te cannot build this model: multi-latent attention .*"
                                         r"dense layers inside an MoE .* \(use trainer.spec: local or auto\)"):
        build_layer_spec(mla, build_transformer_config(mla, TrainerConfig()), "te")


def test_config_cross_field_checks():
    with pytest.raises(ConfigError):
        TrainerConfig(spec="te", device="cpu").check("trainer")
    with pytest.raises(ConfigError):
        AlgoConfig(length_norm="constant").check("algo")
    with pytest.raises(ConfigError):
        AlgoConfig(dual_clip_c=0.5).check("algo")
    AlgoConfig(length_norm="constant", length_norm_constant=64).check("algo")


def test_variable_lengths_are_set_only_for_pipelines_and_refused_by_the_allgather_moe_dispatcher():
    from dora_megatron.trainer.model import build_transformer_config

    dense = arch_from_hf_config({**{k: v for k, v in MOE.items() if k != "num_experts"}, "model_type": "qwen3"})
    moe = arch_from_hf_config(MOE)
    budget = TrainerConfig(max_tokens_per_micro_batch=4096)
    assert build_transformer_config(dense, TrainerConfig(pp=2, max_tokens_per_micro_batch=4096)).variable_seq_lengths
    assert not build_transformer_config(moe, budget).variable_seq_lengths  # no p2p: shapes need not travel
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch"):
        build_transformer_config(moe, TrainerConfig(pp=2, max_tokens_per_micro_batch=4096))
    # the alltoall dispatcher sends each micro-batch's shape: allowed (and it runs on cpu)
    a2a = TrainerConfig(pp=2, max_tokens_per_micro_batch=4096, moe_token_dispatcher="alltoall")
    assert build_transformer_config(moe, a2a).variable_seq_lengths


GLM = {**{k: v for k, v in MOE.items() if k not in ("num_experts", "mlp_only_layers", "decoder_sparse_step",
                                                     "norm_topk_prob", "head_dim", "rope_parameters")},
       "model_type": "glm4_moe", "num_hidden_layers": 4, "n_routed_experts": 8, "n_shared_experts": 2,
       "first_k_dense_replace": 2, "partial_rotary_factor": 0.5, "rope_theta": 1e6, "use_qk_norm": True,
       "attention_bias": True, "n_group": 4, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True}


def test_glm4_moe_fields_come_from_its_config_keys():
    """A GLM-4.5 config as transformers 4.x wrote it (top-level partial_rotary_factor and rope_theta):
    the first first_k_dense_replace layers dense, n_shared_experts experts' width shared, half the
    head rotated, QK-norm and q/k/v bias from their switches, the sigmoid router's groups and scale."""
    a = arch_from_hf_config(GLM)
    assert a.sparse_layers == (2, 3) and a.num_experts == 8 and a.moe_intermediate_size == 96
    assert a.shared_expert_intermediate_size == 2 * 96 and not a.shared_expert_gate
    assert a.shared_expert_module == "shared_experts" and a.head_dim == 16 and a.rotary_dim == 8
    assert a.rotary_percent == 0.5 and a.qk_norm and a.qkv_bias and not a.o_bias
    assert (a.router, a.router_expert_bias, a.router_groups, a.router_group_topk) == ("sigmoid", True, 4, 1)
    assert a.routed_scaling_factor == 2.5 and a.norm_topk_prob and a.tie_word_embeddings
    plain = arch_from_hf_config({**GLM, "use_qk_norm": False, "attention_bias": False, "first_k_dense_replace": 0,
                                 "partial_rotary_factor": 1.0})
    assert not plain.qk_norm and not plain.qkv_bias and plain.sparse_layers == (0, 1, 2, 3) and plain.rotary_dim == 0
    # transformers' own default for an omitted partial_rotary_factor is 0.5 (Glm4MoeConfig.__post_init__)
    assert arch_from_hf_config({k: v for k, v in GLM.items() if k != "partial_rotary_factor"}).rotary_dim == 8


@pytest.mark.parametrize("patch,match", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false with sigmoid routing"),
    ({"n_group": 2, "topk_group": 2}, "n_group=2 with num_experts_per_tok=2 and topk_group=2")])
def test_glm4_moe_routing_the_trainer_cannot_build_is_refused(patch, match):
    from dora_megatron.models.hf_config import spec_from_dict

    assert spec_from_dict({**GLM, **patch}).engine_problems() == []  # the engine computes transformers' routing
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config({**GLM, **patch})


def test_gpt_oss_refusal_names_what_megatron_lacks():
    with pytest.raises(ValueError) as err:
        arch_from_hf_config({**MOE, "model_type": "gpt_oss"})
    msg = str(err.value)
    assert "model_type 'gpt_oss' is not supported: gpt-oss needs attention sinks" in msg
    for piece in ("sliding-window", "clamped SwiGLU", "Megatron-Core 0.16.1", "torch.cuda.current_device()",
                  "glm4_moe, deepseek_v3)"):
        assert piece in msg, piece


def test_megatron_router_fields_per_router_kind():
    from dora_megatron.trainer.megatron_args import router_kwargs

    glm = router_kwargs(arch_from_hf_config(GLM))
    assert glm["moe_router_score_function"] == "sigmoid" and glm["moe_router_enable_expert_bias"]
    assert (glm["moe_router_num_groups"], glm["moe_router_group_topk"], glm["moe_router_topk_scaling_factor"]) == (4, 1, 2.5)
    assert glm["moe_router_bias_update_rate"] == 0.0  # the checkpoint's bias is held, not re-balanced
    ungrouped = router_kwargs(arch_from_hf_config({**GLM, "n_group": 1, "routed_scaling_factor": 1.0}))
    assert ungrouped["moe_router_num_groups"] is None and ungrouped["moe_router_topk_scaling_factor"] is None
    assert router_kwargs(arch_from_hf_config(MOE)) == {"moe_router_score_function": "softmax",
                                                      "moe_router_pre_softmax": True}


#: YaRN variants of a Qwen3-MoE config: transformers' defaults (cos/sin scaled by 0.1 ln(factor) + 1),
#: an mscale pair (scaled by their ratio), an mscale alone (ignored by transformers), truncate off,
#: and no factor (max_position_embeddings / original_max_position_embeddings)
YARNS = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 2.0, "mscale_all_dim": 1.0,
     "beta_fast": 16.0, "beta_slow": 2.0},
    {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707},
    {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
    {"factor": None, "original_max_position_embeddings": 256},
]


@pytest.mark.parametrize("yarn", YARNS)
def test_megatron_yarn_rotary_equals_transformers_yarn(yarn):
    """The YaRN rotary Megatron-Core builds from the trainer's config (its frequencies and the cos/sin
    scaling its attention applies) is transformers' for the same config.json."""
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding, _yarn_get_concentration_factor_from_config)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dora_megatron.trainer.cpu_compat import cpu_compat
    from dora_megatron.trainer.model import build_transformer_config

    cfg = {**MOE, "max_position_embeddings": 1024,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn}}
    arch = arch_from_hf_config(cfg)
    config = build_transformer_config(arch, TrainerConfig())
    with cpu_compat():
        rotary = YarnRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_base=arch.rope_theta, use_cpu_initialization=True,
            scaling_factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow, mscale=config.yarn_mscale,
            mscale_all_dim=config.yarn_mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int)
        emb, _ = rotary(16)
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen3MoeConfig(**cfg), None)
    positions = torch.arange(16, dtype=torch.float32)
    torch.testing.assert_close(emb[:, 0, 0, : arch.head_dim // 2], torch.outer(positions, hf_inv_freq))
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(hf_scaling, rel=1e-12)
    assert hf_scaling != 1.0 and not config.apply_rope_fusion


def test_partial_rotary_yarn_rotates_the_rotary_share_with_transformers_frequencies():
    """GLM-4.5's partial rotary with YaRN: the rotary the trainer builds (frequencies over the
    rotated half of each head, and the cos/sin scaling its attention applies) is transformers' for
    the same config.json; Megatron's own YaRN over the whole head would not be."""
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding, _yarn_get_concentration_factor_from_config)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dora_megatron.trainer.cpu_compat import cpu_compat
    from dora_megatron.trainer.model import build_transformer_config
    from dora_megatron.trainer.yarn_config import partial_rotary_yarn

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.5}
    cfg = {**{k: v for k, v in GLM.items() if k not in ("partial_rotary_factor", "rope_theta")},
           "max_position_embeddings": 1024, "rope_parameters": yarn}
    arch = arch_from_hf_config(cfg)
    config = build_transformer_config(arch, TrainerConfig())
    assert arch.rotary_dim == config.kv_channels // 2
    with cpu_compat():
        emb, _ = partial_rotary_yarn(config, arch.rotary_dim, arch.rope_theta)(16)
        whole, _ = YarnRotaryEmbedding(kv_channels=config.kv_channels, rotary_base=arch.rope_theta,
                                       use_cpu_initialization=True, scaling_factor=4.0,
                                       original_max_position_embeddings=64)(16)
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](transformers.Glm4MoeConfig(**cfg), None)
    positions = torch.arange(16, dtype=torch.float32)
    assert emb.shape[-1] == arch.rotary_dim == 2 * hf_inv_freq.numel()
    torch.testing.assert_close(emb[:, 0, 0, : arch.rotary_dim // 2], torch.outer(positions, hf_inv_freq))
    assert whole.shape[-1] != arch.rotary_dim  # what GPTModel builds by itself
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(hf_scaling, rel=1e-12)


def test_yarn_the_trainer_cannot_build_is_refused_naming_the_key():
    """For MLA a truncate=false or an mscale_all_dim without mscale (Megatron's MLA cannot express
    either); the embedded engine computes both (transformers' own rope functions)."""
    from dora_megatron.models.hf_config import spec_from_dict

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    cases = [({**DEEPSEEK, "rope_parameters": {**yarn, "truncate": False}}, "rope_parameters.truncate=false"),
             ({**DEEPSEEK, "rope_parameters": {**yarn, "mscale_all_dim": 1.0}},
              "rope_parameters.mscale_all_dim without rope_parameters.mscale")]
    for cfg, match in cases:
        assert spec_from_dict(cfg).engine_problems() == []
        with pytest.raises(ValueError, match=match):
            arch_from_hf_config(cfg)
    full = arch_from_hf_config({**GLM, "rope_parameters": {**yarn, "partial_rotary_factor": 1.0}})
    assert full.rope_type == "yarn" and full.rotary_dim == 0
