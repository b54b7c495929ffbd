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

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.down_proj$")


def load_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {model_dir}")
    return json.loads(path.read_text())


#: what the trainer (Megatron-Core Qwen3 / Qwen3-MoE bridge) and the embedded engine load
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


def check_model_dir(model_dir: str | Path, need_tokenizer: bool = True) -> list[str]:
    """Problems that would stop a job on this HF directory, found before any process starts
    (empty list: usable): config.json readable with a supported ``model_type``, weights present,
    and (the controller decodes responses) ``tokenizer.json``."""
    d = Path(model_dir)
    if not d.is_dir():
        return [f"{d} is not a directory"]
    problems = []
    try:
        config = json.loads((d / CONFIG_FILE).read_text())
        model_type = config.get("model_type") if isinstance(config, dict) else None
        if model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(f"{d / CONFIG_FILE}: model_type {model_type!r} is not supported "
                            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    except FileNotFoundError:
        problems.append(f"no {CONFIG_FILE} in {d}")
    except (OSError, ValueError) as err:
        problems.append(f"{d / CONFIG_FILE} is not valid JSON: {err}")
    if not (d / WEIGHTS_FILE).is_file() and not (d / INDEX_FILE).is_file():
        problems.append(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {d}")
    if need_tokenizer and not (d / "tokenizer.json").is_file():
        problems.append(f"no tokenizer.json in {d} (engines take token ids; the controller needs the tokenizer)")
    return problems


def is_moe(config: dict[str, Any]) -> bool:
    return int(config.get("num_experts", 0) or 0) > 0


def is_sparse_layer(config: dict[str, Any], layer: int) -> bool:
    """Qwen3-MoE's rule for which decoder layers use routed experts."""
    if not is_moe(config):
        return False
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a Qwen3 / Qwen3-MoE model of ``config`` has."""
    h = int(config["hidden_size"])
    v = int(config["vocab_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config["num_key_value_heads"])
    d = head_dim(config)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if config.get("attention_bias", False):
            shapes[p + "self_attn.q_proj.bias"] = (nh * d,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * d,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * d,)
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if is_sparse_layer(config, i):
            inter = int(config["moe_intermediate_size"])
            shapes[p + "mlp.gate.weight"] = (int(config["num_experts"]), h)
            for e in range(int(config["num_experts"])):
                q = f"{p}mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (inter, h)
                shapes[q + "up_proj.weight"] = (inter, h)
                shapes[q + "down_proj.weight"] = (h, inter)
        else:
            inter = int(config["intermediate_size"])
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


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
    """All tensors of an HF directory (single file or sharded with an index), per-expert layout."""
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

    gen = torch.Generator().manual_seed(int(seed))
    std = float(config.get("initializer_range", 0.02))
    state: dict[str, Any] = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if len(shape) == 1:
            state[name] = torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) * std
    return state
