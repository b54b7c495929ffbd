"""Named model presets (Hugging Face ``config.json`` dictionaries) and random-init model dirs.

Why here: the engine, the trainer and the tests must agree on the tiny models used on CPU, so
the configs are fixed in one place. :func:`create_model_dir` is the building block of
``dora init-model`` (a warm start on a task can be layered on top of it later).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dora_megatron.data import tokenizer as tok

_COMMON: dict[str, Any] = {
    "vocab_size": tok.VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": tok.BOS_ID,
    "eos_token_id": tok.EOS_ID,
    "pad_token_id": tok.PAD_ID,
    "torch_dtype": "float32",
    "dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    "tiny-dense": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 256,
        "layer_types": ["full_attention"] * 4,
        "max_window_layers": 4,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's ``config.json`` dictionary."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    import copy

    return copy.deepcopy(PRESETS[name])


def create_model_dir(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised HF model directory (config, safetensors, tokenizer).

    Linear and embedding weights are N(0, initializer_range) from a ``torch.Generator`` seeded
    with ``seed`` (so the same seed gives the same bytes); norm weights are ones.
    """
    from dora_megatron.models import hf_model_dir

    config = preset_config(preset)
    state = hf_model_dir.random_state_dict(config, seed)
    out = Path(out_dir)
    hf_model_dir.save_model_dir(out, config, state)
    tok.save_tokenizer(out)
    return out
