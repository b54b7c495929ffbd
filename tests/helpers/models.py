"""Tiny random model directories for tests (a Qwen3-MoE at init std 0.1, so layers matter)."""

from __future__ import annotations


def make_tiny_moe(out, seed: int) -> str:
    from dora_megatron.models import hf_model_dir
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    cfg["initializer_range"] = 0.1
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, seed))
    return str(out)
