"""Process groups for the trainer: torch.distributed + Megatron ``parallel_state``.

WHY: one place decides the (TP, PP, EP, DP, CP, ETP, VPP) layout of a torchrun job from ``TrainerConfig`` and
returns it as a plain :class:`~dora_megatron.weights.naming.Layout` the rest of the code passes
around explicitly. Megatron keeps its groups in module globals; we initialise and destroy them here
and nowhere else.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.weights.naming import Layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's coordinates; ``layout`` is what weight naming needs."""

    rank: int
    world_size: int
    dp: int
    dp_rank: int
    layout: Layout


def init_distributed(cfg: TrainerConfig) -> ParallelInfo:
    """Initialise torch.distributed (env:// from torchrun, or a 1-rank group) and Megatron groups."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if "RANK" not in os.environ:
            from dora_megatron.ports import free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    dp = cfg.data_parallel_size(world)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            expert_model_parallel_size=cfg.ep,
            context_parallel_size=cfg.cp,
            expert_tensor_parallel_size=cfg.expert_tp,
            virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
            create_gloo_process_groups=True,
        )
    if cfg.device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    else:
        # No dropout on CPU; the inference tracker's fork() is a no-op, which is what we need.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(cfg.seed)
    layout = Layout(
        tp=cfg.tp, tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=cfg.pp, pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=cfg.ep, ep_rank=ps.get_expert_model_parallel_rank(),
        etp=cfg.etp, etp_rank=ps.get_expert_tensor_parallel_rank() if cfg.etp else 0, vpp=cfg.vpp,
    )
    return ParallelInfo(rank=dist.get_rank(), world_size=world, dp=dp,
                        dp_rank=ps.get_data_parallel_rank(), layout=layout)


def destroy_distributed(keep_world: bool = False) -> None:
    """Destroy Megatron's groups and (unless ``keep_world``) the torch.distributed world."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()


