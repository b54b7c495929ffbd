"""Group-relative advantages (GRPO) as pure functions.

WHY: advantages need the whole group (DESIGN section 2: a group is released only when all G
samples are finished); computing them from (rewards, group ids) keeps them independent of batch
order and of how samples were split across micro-batches or ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor, *,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantage ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` without std).

    ``std_g`` is the unbiased (n-1) standard deviation of the group's rewards; a group of one
    sample gets advantage 0. Returns a float tensor shaped like ``rewards``."""
    rewards = rewards.to(torch.float64).flatten()
    gids = torch.as_tensor(group_ids).flatten()
    if gids.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {gids.numel()} group ids")
    adv = torch.zeros_like(rewards)
    for g in torch.unique(gids):
        idx = (gids == g).nonzero(as_tuple=True)[0]
        r = rewards[idx]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        adv[idx] = centred / (r.std(unbiased=True) + eps) if normalize_std else centred
    return adv.to(torch.float32)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor,
                       eps: float = 1e-6) -> torch.Tensor:
    """Registry entry point: ``name`` is one of ``dora_megatron.algo.ADVANTAGE_ESTIMATORS``."""
    if name == "grpo":
        return grpo_advantages(rewards, group_ids, normalize_std=True, eps=eps)
    if name == "grpo_no_std":
        return grpo_advantages(rewards, group_ids, normalize_std=False, eps=eps)
    raise KeyError(f"unknown advantage estimator {name!r}")
