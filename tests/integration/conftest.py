"""Shared integration fixtures: a tiny random Qwen3-MoE directory (init std 0.1 so layers matter)."""

from __future__ import annotations

import pytest


def make_tiny_moe(out, seed: int) -> str:
    from dora_megatron.models import hf_io
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    cfg["initializer_range"] = 0.1
    hf_io.save_model_dir(out, cfg, hf_io.random_state_dict(cfg, seed))
    return str(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tiny MoE with seed 0; a test module may override it (e.g. another seed)."""
    return make_tiny_moe(tmp_path_factory.mktemp("moe"), seed=0)
