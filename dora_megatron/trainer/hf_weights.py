"""Read Hugging Face safetensors into a Megatron model chunk and gather it back out.

WHY: loading and exporting are collective, rank-aware operations on live Megatron modules; the
naming rules themselves are pure and live in :mod:`dora_megatron.weights.naming`.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Iterator

import torch
import torch.distributed as dist

from dora_megatron.models import fp8_checkpoint
from dora_megatron.models.hf_config import CONFIG_FILE, mtp_names, read_json
from dora_megatron.weights import naming

logger = logging.getLogger(__name__)


def read_hf_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of ``hf_dir/*.safetensors`` (fp32, CPU); a block-FP8 checkpoint's weights
    dequantized (:mod:`dora_megatron.models.fp8_checkpoint`)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    config_path = os.path.join(hf_dir, CONFIG_FILE)
    config = read_json(hf_dir) if os.path.isfile(config_path) else {}
    sd = fp8_checkpoint.dequantize_state(sd, config, config_path)
    return {k: v.float() for k, v in sd.items()}


def read_hf_names(hf_dir: str) -> list[str]:
    """The tensor names of ``hf_dir/*.safetensors`` (headers only, no tensor read)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(f, "pt") as handle:
            names += list(handle.keys())
    return names


def warn_skipped_mtp(names, arch) -> list[str]:
    """Log (a warning) and return the multi-token-prediction tensors among ``names`` that the
    trainer leaves out: it does not train them, `dora convert` does not write them, and a trained
    version has none."""
    skipped = mtp_names(names, arch.num_layers)
    if skipped:
        logger.warning("skipping %d tensors of %d multi-token-prediction layer(s) (num_nextn_predict_layers): the "
                       "trainer does not train them and no converted checkpoint or trained version has them",
                       len(skipped), getattr(arch, "mtp_layers", 0))
    return skipped


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def model_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and the buffers that are model weights (:func:`naming.is_carried_buffer`:
    the sigmoid router's correction bias, which Megatron keeps as a buffer, so a load or an export
    over ``named_parameters`` alone would silently drop it)."""
    return list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if naming.is_carried_buffer(n)]


@torch.no_grad()
def load_hf_into_model(model: torch.nn.Module, hf_sd: dict[str, torch.Tensor], arch,
                       layout: naming.Layout) -> None:
    """Copy HF weights into this rank's (unwrapped or DDP-wrapped) GPTModel; every parameter must be covered."""
    warn_skipped_mtp(hf_sd, arch)
    local = naming.hf_state_dict_to_megatron(hf_sd, arch, layout)
    module = unwrap(model)
    missing = []
    for name, param in model_weights(module):
        cname = naming.canonical_name(name)
        if cname == "output_layer.weight" and cname not in local and "embedding.word_embeddings.weight" in local:
            src = local["embedding.word_embeddings.weight"]
        else:
            src = local.get(cname)
        if src is None:
            missing.append(name)
            continue
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"{name}: HF-derived shape {tuple(src.shape)} != parameter {tuple(param.shape)}")
        param.copy_(src.to(param.dtype))
    if missing:
        raise KeyError(f"parameters without HF weights: {missing}")


@torch.no_grad()
def gather_megatron_global(model: torch.nn.Module, arch, layout: naming.Layout) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) tensors of this rank's parameters under global names, only for the
    parameters this rank is responsible for exporting (DP/expert-DP rank 0, TP rank 0).

    Collective over the TP / expert-TP groups: every rank must call it."""
    from megatron.core import parallel_state as ps

    module = unwrap(model)
    out: dict[str, torch.Tensor] = {}
    for name, param in model_weights(module):
        cname = naming.canonical_name(name)
        if not cname:
            continue
        expert = naming.is_expert_param(cname)
        data = param.detach()
        if (layout.expert_tp if expert else layout.tp) > 1 and naming.tp_kind(cname) != "replicated":
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            size = dist.get_world_size(group)
            shards = [torch.empty_like(data) for _ in range(size)]
            dist.all_gather(shards, data.contiguous(), group=group)
            data = naming.merge_tp(cname, shards)
        if expert:
            owner = ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
        else:
            owner = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        if owner:
            out[naming.local_to_global_name(cname, arch, layout)] = data.detach().cpu().clone()
    return out


def export_hf(model: torch.nn.Module | list[torch.nn.Module], arch, layout: naming.Layout
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of the whole model, yielded on global rank 0 only (in ``hf_names``
    order); other ranks yield nothing. ``model``: this rank's chunk, or its list of chunks (interleaved
    pipeline; chunk ``v`` has ``layout.chunk(v)``). Collective: every rank must exhaust the iterator."""
    chunks = model if isinstance(model, list) else [model]
    local: dict[str, torch.Tensor] = {}
    for v, chunk in enumerate(chunks):
        local.update(gather_megatron_global(chunk, arch, layout.chunk(v) if len(chunks) > 1 else layout))
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, parts, dst=0)
        if dist.get_rank() != 0:
            return
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
    else:
        merged = local
    yield from naming.hf_export(merged, arch)
