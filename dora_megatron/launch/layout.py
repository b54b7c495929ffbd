"""Trainer layouts (TP/PP/EP) checked against the model's Hugging Face config, before anything starts.

Why: Megatron refuses an impossible layout only once every rank has built its process groups, i.e.
after the warm start and the engines have started, and torchrun then buries the reason under its
``ChildFailedError`` banner. The same rules, read from ``config.json`` alone (stdlib only, no
torch), let ``dora train`` (also ``--dry-run``) and ``dora convert`` refuse such a layout at once
with the reason. They mirror what :func:`dora_megatron.trainer.model.build_transformer_config`
enforces on the ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _int(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        if cfg.get(k):
            return int(cfg[k])
    return default


def layout_problems(hf_config: dict[str, Any], tp: int, pp: int, ep: int, prefix: str = "trainer.") -> list[str]:
    """Why a ``tp`` x ``pp`` x ``ep`` layout cannot hold the model ``hf_config`` (empty: it can).

    Each problem names the size (``{prefix}tp`` etc.) and the model dimension it must divide."""
    problems = []
    layers = _int(hf_config, "num_hidden_layers")
    heads = _int(hf_config, "num_attention_heads")
    kv_heads = _int(hf_config, "num_key_value_heads", default=heads)
    experts = _int(hf_config, "num_experts", "num_local_experts")
    if layers and layers % pp:
        problems.append(f"{prefix}pp={pp}: the model's {layers} layers are not divisible by pp")
    if heads and (heads % tp or kv_heads % tp):
        problems.append(f"{prefix}tp={tp}: the model's attention heads ({heads} query, {kv_heads} key/value) "
                        "are not divisible by tp")
    if ep > 1 and not experts:
        problems.append(f"{prefix}ep={ep} needs an MoE model with experts divisible by ep; the model "
                        f"({hf_config.get('model_type', '?')}) is dense: use ep=1")
    elif ep > 1 and experts % ep:
        problems.append(f"{prefix}ep={ep}: the model's {experts} experts are not divisible by ep")
    return problems


def read_hf_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json`` of ``model_dir``, or None when it is missing or unreadable (reported elsewhere)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def trainer_layout_problem(cfg) -> str | None:
    """Why ``trainer.tp/pp/ep`` cannot hold the job's model (``model.path`` or the preset), or None."""
    from dora_megatron.models.presets import preset_config

    trainer = cfg.trainer
    hf_config = read_hf_config(cfg.model.path) if cfg.model.path else preset_config(cfg.model.preset)
    if hf_config is None:
        return None
    problems = layout_problems(hf_config, trainer.tp, trainer.pp, trainer.ep)
    where = f"model.path {cfg.model.path}" if cfg.model.path else f"model.preset {cfg.model.preset}"
    return f"{'; '.join(problems)} ({where})" if problems else None
