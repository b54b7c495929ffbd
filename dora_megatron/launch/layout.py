"""Trainer layouts (TP/PP/EP/VPP/ETP, recompute chunks) checked against the model's Hugging Face
config, before anything starts; the per-rank memory estimate against ``cluster.gpu_memory_gb``.

Why: Megatron refuses an impossible layout only once every rank has built its process groups, i.e.
after the warm start and the engines have started, and torchrun then buries the reason under its
``ChildFailedError`` banner. The same rules, read from ``config.json`` alone (no torch), let
``dora train`` (also ``--dry-run``) and ``dora convert`` refuse such a layout at once with the reason.
They mirror what :func:`dora_megatron.trainer.model.build_transformer_config` enforces on the ranks.
``trainer.megatron`` is the exception that imports Megatron (only when set): its names are checked
against Megatron's own dataclasses and the resulting configs are built once, so Megatron's own
``__post_init__`` rules refuse a bad value here rather than on every rank.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def layout_problems(hf_config: dict[str, Any], tp: int, pp: int, ep: int, prefix: str = "trainer.",
                    even_pp: bool = True) -> list[str]:
    """Why a ``tp`` x ``pp`` x ``ep`` layout cannot hold the model ``hf_config`` (empty: it can).

    The config is read by the one reader (:mod:`dora_megatron.models.hf_config`, transformers' own
    classes), so every spelling means here what it means to the engine and the trainer; a config that
    reader refuses is reported by the model-directory check, not here. Each problem names the size
    (``{prefix}tp`` etc.) and the model dimension it must divide. ``even_pp`` False: an uneven pipeline
    split is asked for, whose counts are checked against Megatron's rules instead
    (:func:`dora_megatron.trainer.pipeline_split.trainer_split`)."""
    from dora_megatron.models.hf_config import spec_from_dict

    try:
        spec = spec_from_dict(hf_config)
    except (ValueError, KeyError, TypeError):
        return []
    problems = []
    if even_pp and spec.num_layers % pp:
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


def trainer_section_problems(hf_config: dict[str, Any], trainer) -> list[str]:
    """:func:`layout_problems` plus the rules of the other trainer knobs that need the model's shape:
    interleaved stages (``vpp``), an uneven pipeline split (``trainer.megatron``'s split fields, checked
    by Megatron's own rules), expert tensor parallelism (``etp``) and the recompute chunks."""
    from dora_megatron.models.hf_config import spec_from_dict

    uneven = _uneven(trainer)
    problems = layout_problems(hf_config, trainer.tp, trainer.pp, trainer.ep, even_pp=not uneven)
    try:
        spec = spec_from_dict(hf_config)
    except (ValueError, KeyError, TypeError):
        return problems
    chunks = trainer.pp * trainer.vpp
    counts: list[int] = []  # layers of each model chunk; empty where the split itself is refused
    if uneven:
        from dora_megatron.trainer.pipeline_split import trainer_split

        try:
            counts = [n for row in trainer_split(spec, trainer).chunks for _, n in row]
        except ValueError as err:
            problems.append(str(err))
    elif trainer.vpp > 1 and spec.num_layers % chunks:
        problems.append(f"trainer.vpp={trainer.vpp}: the model's {spec.num_layers} layers cannot be split into "
                        f"pp*vpp={chunks} equal virtual stages")
    elif spec.num_layers % chunks == 0:
        counts = [spec.num_layers // chunks]
    if trainer.etp and not spec.num_experts:
        problems.append(f"trainer.etp={trainer.etp} applies to MoE experts; the model ({spec.model_type}) is dense: "
                        "set etp=0")
    elif spec.num_experts and spec.moe_intermediate_size % (trainer.etp or trainer.tp):
        key = "trainer.etp" if trainer.etp else "trainer.tp"
        problems.append(f"{key}={trainer.etp or trainer.tp}: the experts' moe_intermediate_size "
                        f"{spec.moe_intermediate_size} is not divisible by the expert tensor-parallel size")
    if not spec.num_experts and spec.intermediate_size % trainer.tp:
        problems.append(f"trainer.tp={trainer.tp}: the model's intermediate_size {spec.intermediate_size} is not "
                        "divisible by tp")
    if trainer.recompute == "full" and counts:
        n = trainer.recompute_num_layers
        undivided = [c for c in counts if c % n]
        if trainer.recompute_method == "uniform" and undivided:
            problems.append(f"trainer.recompute_num_layers={n}: recompute_method uniform splits the {undivided[0]} "
                            "layers of each stage into equal chunks, which this does not divide")
        if trainer.recompute_method == "block" and n > min(counts):
            problems.append(f"trainer.recompute_num_layers={n}: recompute_method block recomputes at most the "
                            f"{min(counts)} layers of a stage")
    return problems


def _uneven(trainer) -> bool:
    """``trainer.megatron`` asks for an uneven pipeline split (imports nothing when it is empty)."""
    if not trainer.megatron:
        return False
    from dora_megatron.trainer.pipeline_split import uneven_fields

    return bool(uneven_fields(trainer.megatron))


def megatron_value_problems(hf_config: dict[str, Any], trainer) -> list[str]:
    """Megatron's own refusal of the configs ``trainer.megatron`` leads to (they are built once here)."""
    from dora_megatron.models.hf_config import spec_from_dict
    from dora_megatron.trainer import megatron_args as ma
    from dora_megatron.trainer.model import choose_spec, te_available

    try:
        arch = spec_from_dict(hf_config)
    except (ValueError, KeyError, TypeError):
        return []
    classes = ma.megatron_classes()
    spec = choose_spec(trainer.spec, trainer.device, arch, te_importable=te_available())
    # the fused kernels' own checks need Transformer Engine, which the machine of a dry run may lack
    here = trainer if spec == "te" else dataclasses.replace(trainer, fusions=False)
    # the class the trainer builds (MLATransformerConfig for MLA, YarnTransformerConfig for YaRN)
    classes["TransformerConfig"] = ma.transformer_config_class(arch)
    builds = (("TransformerConfig", lambda: ma.transformer_kwargs(arch, here, spec)),
              ("OptimizerConfig", lambda: ma.optimizer_kwargs(trainer)),
              ("DistributedDataParallelConfig", lambda: ma.ddp_kwargs(trainer)))
    problems = []
    for name, kwargs in builds:
        try:
            classes[name](**kwargs())
        except (AssertionError, ValueError, TypeError) as err:
            problems.append(f"trainer.megatron: Megatron's {name} refuses the result: {err}")
    return problems


def read_hf_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json`` of ``model_dir``, or None when it is missing or unreadable (reported elsewhere)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def job_hf_config(cfg) -> dict[str, Any] | None:
    """The job model's ``config.json`` (``model.path`` or the preset); None when it cannot be read."""
    from dora_megatron.models.presets import preset_config

    return read_hf_config(cfg.model.path) if cfg.model.path else preset_config(cfg.model.preset)


def memory_estimate(cfg, hf_config: dict[str, Any] | None = None):
    """:func:`dora_megatron.trainer.memory.estimate` for the job (None without a readable config.json)."""
    from dora_megatron.models.hf_config import spec_from_dict
    from dora_megatron.trainer.memory import estimate

    hf_config = hf_config if hf_config is not None else job_hf_config(cfg)
    if hf_config is None:
        return None
    try:
        arch = spec_from_dict(hf_config)
    except (ValueError, KeyError, TypeError):
        return None
    stage_layers = None
    if _uneven(cfg.trainer):  # the first pipeline rank's layers as Megatron splits them
        from dora_megatron.trainer.pipeline_split import trainer_split

        try:
            stage_layers = trainer_split(arch, cfg.trainer).rank_layers(0)
        except ValueError:  # the split is refused, with its reason, by trainer_layout_problem
            return None
    return estimate(arch, cfg.trainer, cfg.launch.trainer_procs, stage_layers=stage_layers)


def memory_problem(cfg, hf_config: dict[str, Any] | None = None) -> str | None:
    """Why the trainer's per-rank estimate exceeds ``cluster.gpu_memory_gb`` (cuda only), or None."""
    from dora_megatron.trainer.memory import GIB

    limit = cfg.cluster.gpu_memory_gb
    if not limit or cfg.trainer.device != "cuda":
        return None
    est = memory_estimate(cfg, hf_config)
    if est is None or est.total <= limit * GIB:
        return None
    return (f"cluster.gpu_memory_gb={limit:g}: the trainer needs an estimated {est.total / GIB:.1f} GiB per rank "
            f"(parameters {est.params / GIB:.1f}, gradients {est.grads / GIB:.1f}, optimizer {est.optimizer / GIB:.1f}, "
            f"activations {(est.activations + est.workspace) / GIB:.1f}, logits {est.logits / GIB:.1f}): use trainer.precision bf16, "
            "trainer.recompute, more tp/ep/pp, or a smaller micro-batch (dora train --dry-run prints the table)")


def trainer_layout_problem(cfg) -> str | None:
    """Why the trainer section cannot hold the job's model (``model.path`` or the preset), or None:
    layout, the knobs that need the model's shape, ``trainer.megatron``'s names, the memory fit."""
    trainer = cfg.trainer
    problems = []
    if trainer.megatron:  # names checked against Megatron's own dataclasses (imports Megatron: only when used)
        from dora_megatron.trainer.megatron_args import megatron_field_problems

        problems += megatron_field_problems(trainer.megatron)
    hf_config = job_hf_config(cfg)
    if hf_config is None:
        return "; ".join(problems) or None
    problems += trainer_section_problems(hf_config, trainer)
    if trainer.megatron and not problems:
        problems += megatron_value_problems(hf_config, trainer)
    if not problems:
        fit = memory_problem(cfg, hf_config)
        if fit:
            problems.append(fit)
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
