"""The per-rank memory estimate: each knob moves the term it should, and the dry run refuses a
layout that does not fit ``cluster.gpu_memory_gb`` (the shipped 30B config fits 80 GiB only with its
bf16 + full recompute settings)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dora_megatron.config.schema import load_config
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.launch.layout import memory_problem, trainer_layout_problem
from dora_megatron.models.hf_config import spec_from_dict
from dora_megatron.trainer.memory import GIB, estimate

ROOT = Path(__file__).resolve().parents[3]
QWEN30B = ROOT / "configs" / "models" / "Qwen3-30B-A3B"


def _arch():
    return spec_from_dict(json.loads((QWEN30B / "config.json").read_text()))


def test_parameter_count_is_the_models():
    """One rank of tp=ep=pp=1 holds all 30.5 B parameters (the model card's total)."""
    est = estimate(_arch(), TrainerConfig(device="cuda", max_seq_len=128), world_size=1)
    assert 30.3e9 < est.param_count < 30.7e9


#: DeepSeek-V3's config.json (the Hub's, transformers 4.x spelling), without the quantization block
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}


def test_mla_parameter_count_is_deepseek_v3s():
    """Multi-latent attention, shared experts and dense first layers counted: DeepSeek-V3's 671 B
    (the model card's total without its 14 B multi-token-prediction module); a GQA count of the
    same config (num_key_value_heads heads of head_dim) would be 3 B off."""
    arch = spec_from_dict(DEEPSEEK_V3)
    est = estimate(arch, TrainerConfig(device="cuda", max_seq_len=128), world_size=1)
    assert 670.5e9 < est.param_count < 671.5e9
    gqa = estimate(replace(arch, kv_lora_rank=0), TrainerConfig(device="cuda", max_seq_len=128), world_size=1)
    assert abs(gqa.param_count - est.param_count) > 2e9


def test_each_knob_moves_its_term():
    arch = _arch()
    base = TrainerConfig(device="cuda", tp=4, ep=8, max_seq_len=8192)
    ref = estimate(arch, base, 32)
    bf16 = estimate(arch, replace(base, precision="bf16"), 32)
    assert bf16.params == ref.params / 2 and bf16.grads == ref.grads  # fp32 main grads either way
    assert bf16.optimizer > ref.optimizer  # + the fp32 main parameters
    assert abs(bf16.activations / ref.activations - 0.5) < 0.01  # bf16 activations (the router scores stay fp32)
    full = estimate(arch, replace(base, recompute="full"), 32)
    assert full.activations < ref.activations / 10
    # with TE's fused attention there is no s x s score tensor for selective recompute to drop
    assert estimate(arch, replace(base, recompute="selective"), 32).activations == ref.activations
    local = replace(base, spec="local")
    assert estimate(arch, replace(local, recompute="selective"), 32).activations < estimate(arch, local, 32).activations
    assert estimate(arch, replace(base, use_distributed_optimizer=False), 32).optimizer > ref.optimizer
    assert estimate(arch, replace(base, optimizer_cpu_offload=True), 32).optimizer == 0
    assert estimate(arch, replace(base, tp=8, ep=4), 32).params < ref.params
    assert estimate(arch, replace(base, max_seq_len=4096), 32).activations < ref.activations


def test_shipped_30b_config_fits_and_its_fp32_form_is_refused():
    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b_multinode.yaml", [f"model.path={QWEN30B}"])
    assert memory_problem(cfg) is None and trainer_layout_problem(cfg) is None
    fp32 = load_config(ROOT / "configs" / "qwen3_30b_a3b_multinode.yaml",
                       [f"model.path={QWEN30B}", "trainer.precision=fp32", "trainer.recompute=none"])
    problem = trainer_layout_problem(fp32)
    assert problem and problem.startswith("cluster.gpu_memory_gb=80: the trainer needs an estimated")
    assert estimate(_arch(), fp32.trainer, 32).total > 80 * GIB


def test_parameter_count_is_each_familys_model():
    """Each family's tiny model as transformers builds it (GLM-4.5: a dense first layer beside MoE
    layers, shared experts, q/k/v biases; Qwen2-MoE: a gated shared expert): a rank of tp=ep=pp=1
    holds the model's parameters (to the per-layer norms the estimate rounds over)."""
    import torch
    import transformers

    from dora_megatron.models.example import tiny_config_kwargs

    for family in ("qwen2_moe", "mixtral", "glm4_moe"):
        cfg = transformers.CONFIG_MAPPING[family](vocab_size=96, hidden_size=64, num_hidden_layers=4,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  **tiny_config_kwargs(family, 64))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        real = sum(p.numel() for p in model.parameters())
        est = estimate(spec_from_dict(cfg.to_dict()), TrainerConfig(device="cuda", max_seq_len=128), world_size=1)
        assert abs(est.param_count - real) / real < 0.005, (family, est.param_count, real)
