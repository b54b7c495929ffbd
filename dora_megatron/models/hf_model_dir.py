"""Read and write Hugging Face format model directories (config.json + safetensors).

Why: the embedded engine, the trainer's converters and the tools all exchange weights as HF
checkpoints. The canonical in-memory layout used across the project is the per-expert one
(``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, router ``model.layers.N.mlp.gate.weight``),
which is what transformers 5.x writes on ``save_pretrained`` and what SGLang loads. Fused expert
tensors (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], the
in-memory layout of transformers 5.x) are accepted on read and split into per-expert tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dora_megatron.models import fp8_checkpoint, hf_config

CONFIG_FILE = hf_config.CONFIG_FILE
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.down_proj$")


def load_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` as written (to copy or rewrite it); read its meaning with :mod:`.hf_config`."""
    return hf_config.read_json(model_dir)


def check_model_dir(model_dir: str | Path, need_tokenizer: bool = True, engine_only: bool = False) -> list[str]:
    """Problems that would stop a job on this HF directory, found before any process starts
    (empty list: usable): config.json read by transformers' config class with a supported
    ``model_type`` and an architecture the engine and the trainer build, weights present, and
    (the controller decodes responses) ``tokenizer.json``. ``engine_only``: what the embedded engine
    computes suffices (``dora serve``), not what the trainer builds."""
    d = Path(model_dir)
    if not d.is_dir():
        return [f"{d} is not a directory"]
    problems = []
    try:
        fp8_checkpoint.fp8_block(load_config(d), str(d / CONFIG_FILE))  # before transformers misreads it
        spec = hf_config.read_spec(d)
        problems += [f"{d / CONFIG_FILE}: {p}" for p in (spec.engine_problems() if engine_only else spec.trainer_problems())]
    except (OSError, ValueError) as err:
        problems.append(str(err))
    if not (d / WEIGHTS_FILE).is_file() and not (d / INDEX_FILE).is_file():
        problems.append(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {d}")
    if need_tokenizer and not (d / "tokenizer.json").is_file():
        problems.append(f"no tokenizer.json in {d} (engines take token ids; the controller needs the tokenizer)")
    return problems


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a Qwen3 / Qwen3-MoE model of ``config`` (a config.json dict) has."""
    return hf_config.spec_from_dict(config).expected_shapes()


def unfuse_experts(state: dict[str, Any]) -> dict[str, Any]:
    """Split fused expert tensors (transformers 5.x in-memory layout) into per-expert HF names."""
    out: dict[str, Any] = {}
    for name, t in state.items():
        m = _FUSED_GATE_UP.match(name)
        if m:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
            continue
        m = _FUSED_DOWN.match(name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e].contiguous()
            continue
        out[name] = t
    return out


def load_state_dict(model_dir: str | Path) -> dict[str, Any]:
    """All tensors of an HF directory (single file or sharded with an index), per-expert layout;
    a block-FP8 checkpoint's weights dequantized (:mod:`.fp8_checkpoint`)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    state: dict[str, Any] = {}
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for f in files:
            state.update(load_file(str(model_dir / f)))
    elif (model_dir / WEIGHTS_FILE).is_file():
        state = load_file(str(model_dir / WEIGHTS_FILE))
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {model_dir}")
    state = fp8_checkpoint.dequantize_state(state, load_config(model_dir), str(model_dir / CONFIG_FILE))
    return unfuse_experts(state)


def save_model_dir(model_dir: str | Path, config: dict[str, Any], state: dict[str, Any]) -> Path:
    """Write ``config.json`` and one ``model.safetensors`` (per-expert layout, tensors as given)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, str(model_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return model_dir


def random_state_dict(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random weights for ``config``: N(0, initializer_range) for matrices, ones for norms."""
    import torch

    spec = hf_config.spec_from_dict(config)
    gen = torch.Generator().manual_seed(int(seed))
    std = spec.initializer_range
    state: dict[str, Any] = {}
    for name, shape in sorted(spec.expected_shapes().items()):
        if len(shape) == 1:
            state[name] = torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) * std
    return state
