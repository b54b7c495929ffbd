"""The trainer's model-FLOPs count against torch's own FLOP counter on the transformers model."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from dora_megatron.models.hf_config import spec_from_dict
from dora_megatron.trainer.perf import forward_flops, peak_memory_bytes, reset_peak_memory


def _hf(moe: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, tie_word_embeddings=False)
    cfg = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common) if moe \
        else Qwen3Config(**common)
    if moe:  # the per-expert loop: torch's counter does not see the fused grouped-GEMM kernels
        cfg._experts_implementation = "eager"
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg).eval()
    return model, spec_from_dict(cfg.to_dict())


def _family(family: str):
    """A tiny model of ``family`` (Qwen2-MoE: a gated shared expert), eager per-expert loop."""
    import transformers

    from dora_megatron.models.example import tiny_config_kwargs

    torch.manual_seed(0)
    cfg = transformers.CONFIG_MAPPING[family](vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, **tiny_config_kwargs(family, 64))
    cfg._experts_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), spec_from_dict(cfg.to_dict())


def _dense_layers():
    """A Qwen3-MoE whose layer 0 is dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                         vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128)
    cfg._experts_implementation = "eager"
    return Qwen3MoeForCausalLM(cfg).eval(), spec_from_dict(cfg.to_dict())


def test_forward_flops_match_torchs_count_of_the_matmuls():
    """One token: attention is trivial, so torch's count is the matmul part alone (2 x active weights)."""
    for name, (model, arch) in {"dense": _hf(False), "moe": _hf(True), "qwen2_moe": _family("qwen2_moe"),
                                "mixtral": _family("mixtral"), "glm4_moe": _family("glm4_moe"),
                                "dense-layers": _dense_layers()}.items():
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.tensor([[3]]))
        measured = counter.get_total_flops()
        assert abs(forward_flops(arch, 1) - measured) / measured < 0.02, (name, forward_flops(arch, 1), measured)


def test_cpu_peak_memory_is_reset_and_sees_a_big_allocation():
    reset_peak_memory("cpu")
    before = peak_memory_bytes("cpu")
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    assert peak_memory_bytes("cpu") - before > 48 * 1024 * 1024
    del block
