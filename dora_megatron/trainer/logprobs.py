"""Per-token log-probs and entropy from (possibly vocab-parallel) logits.

WHY: with TP the output layer returns each rank's slice of the vocabulary; log-probs of the
sampled tokens and the entropy need the log-partition over the *whole* vocabulary, so the sums
are all-reduced with Megatron's differentiable ``reduce_from_tensor_model_parallel_region``.
Padded vocabulary rows (Megatron rounds the vocab up to a multiple of TP) are masked out so the
result equals the Hugging Face model's softmax.
"""

from __future__ import annotations

import torch


def _tp_sum(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def _tp_max(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    return x


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                               tp: int = 1, tp_rank: int = 0, with_entropy: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits)[targets]`` and the entropy, both ``[..., T]``; differentiable.

    ``logits`` ``[..., T, V/tp]`` is this rank's vocab slice (rows ``tp_rank*V/tp ...``), ``targets``
    ``[..., T]`` global token ids, ``vocab_size`` the real (unpadded) vocab."""
    logits = logits.float()
    part = logits.shape[-1]
    start = tp_rank * part
    ids = torch.arange(start, start + part, device=logits.device)
    if start + part > vocab_size:
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    m = _tp_max(logits.detach().amax(dim=-1, keepdim=True), tp)
    shifted = logits - m
    exp = torch.exp(shifted)
    log_z = torch.log(_tp_sum(exp.sum(-1, keepdim=True), tp))
    local = targets - start
    in_range = (local >= 0) & (local < part)
    picked = torch.gather(shifted, -1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    picked = _tp_sum(torch.where(in_range, picked, torch.zeros_like(picked)), tp)
    logp = picked - log_z.squeeze(-1)
    entropy = None
    if with_entropy:
        p = torch.exp(shifted - log_z)
        plogit = torch.where(torch.isfinite(shifted), p * shifted, torch.zeros_like(shifted))
        entropy = log_z.squeeze(-1) - _tp_sum(plogit.sum(-1), tp)
    return logp, entropy
