"""Shared fixtures for the embedded-engine unit tests: tiny model directories built once."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(1)


def _make(tmp_path_factory, preset: str, seed: int, std: float | None) -> str:
    from dora_megatron.models import hf_model_dir
    from dora_megatron.models.presets import create_model_dir, preset_config

    out = tmp_path_factory.mktemp(f"{preset}-{seed}")
    if std is None:
        return str(create_model_dir(preset, out, seed))
    cfg = preset_config(preset)
    cfg["initializer_range"] = std  # larger weights: the layers matter, so parity is meaningful
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, seed))
    return str(out)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory, "tiny-moe", 0, 0.1)


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory, "tiny-dense", 0, 0.1)


@pytest.fixture(scope="session")
def moe_model(moe_dir):
    from dora_megatron.rollout.engine.model import load_model

    return load_model(moe_dir)
