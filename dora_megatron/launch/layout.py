"""Trainer layouts (TP/PP/EP) checked against the model's Hugging Face config, before anything starts.

Why: Megatron refuses an impossible layout only once every rank has built its process groups, i.e.
after the warm start and the engines have started, and torchrun then buries the reason under its
``ChildFailedError`` banner. The same rules, read from ``config.json`` alone (no torch), let ``dora train`` (also ``--dry-run``) and ``dora convert`` refuse such a layout at once
with the reason. They mirror what :func:`dora_megatron.trainer.model.build_transformer_config`
enforces on the ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def layout_problems(hf_config: dict[str, Any], tp: int, pp: int, ep: int, prefix: str = "trainer.") -> list[str]:
    """Why a ``tp`` x ``pp`` x ``ep`` layout cannot hold the model ``hf_config`` (empty: it can).

    The config is read by the one reader (:mod:`dora_megatron.models.hf_config`, transformers' own
    classes), so every spelling means here what it means to the engine and the trainer; a config that
    reader refuses is reported by the model-directory check, not here. Each problem names the size
    (``{prefix}tp`` etc.) and the model dimension it must divide."""
    from dora_megatron.models.hf_config import spec_from_dict

    try:
        spec = spec_from_dict(hf_config)
    except (ValueError, KeyError, TypeError):
        return []
    problems = []
    if spec.num_layers % pp:
        problems.append(f"{prefix}pp={pp}: the model's {spec.num_layers} layers are not divisible by pp")
    if spec.num_heads % tp or spec.num_kv_heads % tp:
        problems.append(f"{prefix}tp={tp}: the model's attention heads ({spec.num_heads} query, {spec.num_kv_heads} "
                        "key/value) are not divisible by tp")
    if ep > 1 and not spec.num_experts:
        problems.append(f"{prefix}ep={ep} needs an MoE model with experts divisible by ep; the model "
                        f"({spec.model_type}) is dense: use ep=1")
    elif ep > 1 and spec.num_experts % ep:
        problems.append(f"{prefix}ep={ep}: the model's {spec.num_experts} experts are not divisible by ep")
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
    if cfg.algo.wants_routed_experts:
        from dora_megatron.models.hf_config import spec_from_dict

        try:
            dense = not spec_from_dict(hf_config).num_experts
        except (ValueError, KeyError, TypeError):  # reported by the model-directory check
            dense = False
        if dense:  # a dense engine answers 400 to every return_routed_experts request, after every process is up
            problems.append("algo.routing_replay / algo.router_agreement need an MoE model; the model "
                            f"({hf_config.get('model_type', '?')}) is dense: set both to false")
    where = f"model.path {cfg.model.path}" if cfg.model.path else f"model.preset {cfg.model.preset}"
    return f"{'; '.join(problems)} ({where})" if problems else None
