import pytest

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
    ({"model_type": "deepseek_v3"}, "supported: qwen3, qwen3_moe, qwen2_moe, mixtral"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0,
                          "original_max_position_embeddings": 1024}}, "rope_type 'yarn'")])
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


def test_spec_choice_and_vocab_padding():
    assert choose_spec("auto", "cpu") == "local"
    assert choose_spec("te", "cuda") == "te"
    assert padded_vocab_size(10, 4) == 12 and padded_vocab_size(128, 2) == 128


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
