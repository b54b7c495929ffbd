"""Rollout correction: per-token weights and keep-masks for the trainer/rollout mismatch.

WHY: the engine that sampled a token (bf16 kernels, other MoE routing) and the trainer that
recomputes it disagree on its probability, and in async MoE RL that mismatch, not staleness,
dominates the off-policy error. The correction compares the trainer's recomputed log-probs
(detached, weights before the update) with the engine's and either reweights the token or drops
it. Pure functions of tensors so each rule can be checked by hand.

With ``r_t = exp(trainer_lp_t - rollout_lp_t)`` and the band ``[low, high]``:

* ``none``: keep every token;
* ``token_mis`` (masked importance sampling, token level): drop tokens with ``r_t`` outside the
  band from the loss *and* its normaliser (rejection, as if never sampled);
* ``seq_mis`` (sequence level): the sample's ratio ``rho`` (geometric mean of ``r_t`` over its
  response tokens, or their product) decides for the whole sample; a sample outside the band is
  dropped entirely;
* ``icepop``: IcePop's ``M(r) = r if low <= r <= high else 0``: kept tokens are weighted by
  ``r_t``, tokens outside the band get zero gradient but still count in the normaliser.

The truncated-IS cap (``tis_cap > 0``) composes with all of them: kept tokens are weighted by
``min(r_t, tis_cap)`` (for ``icepop`` the cap bounds its weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Accepted values of ``algo.rollout_correction``.
CORRECTION_MODES = ("none", "token_mis", "seq_mis", "icepop")
SEQ_AGGREGATES = ("geometric", "product")


@dataclass(frozen=True)
class CorrectionSettings:
    """Built from ``AlgoConfig`` (``rollout_correction``, ``correction_low/high``, ``seq_mis_agg``, ``tis_cap``)."""

    mode: str = "none"
    low: float = 0.5
    high: float = 2.0
    seq_agg: str = "geometric"
    tis_cap: float = 0.0


@dataclass
class Correction:
    """``weight`` multiplies the per-token loss; ``loss_mask`` replaces the mask (normaliser included)."""

    weight: torch.Tensor
    loss_mask: torch.Tensor
    dropped: torch.Tensor  # [B, T] 1.0 where a response token was masked out by the band


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Per-sample ``log rho`` ``[B]``: mean (geometric) or sum (product) of the masked log-ratios."""
    total = (log_ratio * mask).sum(-1)
    if agg == "product":
        return total
    if agg == "geometric":
        return total / mask.sum(-1).clamp(min=1)
    raise KeyError(f"unknown seq_mis_agg {agg!r} (choose from {SEQ_AGGREGATES})")


def rollout_correction(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       s: CorrectionSettings) -> Correction:
    """Weights and keep-mask for one micro-batch (``[B, T]`` tensors; ``mask`` 1 on response tokens)."""
    if s.mode not in CORRECTION_MODES:
        raise KeyError(f"unknown rollout_correction {s.mode!r} (choose from {CORRECTION_MODES})")
    mask = mask.to(trainer_logprobs.dtype)
    log_ratio = (trainer_logprobs.detach() - rollout_logprobs.detach()) * mask
    ratio = torch.exp(log_ratio)
    log_low, log_high = torch.log(torch.tensor(s.low)), torch.log(torch.tensor(s.high))
    if s.mode == "seq_mis":
        log_rho = sequence_log_ratio(log_ratio, mask, s.seq_agg)
        keep = ((log_rho >= log_low) & (log_rho <= log_high))[:, None].expand_as(mask)
    elif s.mode in ("token_mis", "icepop"):
        keep = (log_ratio >= log_low) & (log_ratio <= log_high)
    else:
        keep = torch.ones_like(mask, dtype=torch.bool)
    keep_f = keep.to(mask.dtype)
    if s.tis_cap > 0:
        weight = torch.clamp(ratio, max=s.tis_cap)
    elif s.mode == "icepop":
        weight = ratio
    else:
        weight = torch.ones_like(ratio)
    dropped = mask * (1 - keep_f)
    if s.mode == "icepop":
        return Correction(weight=weight * keep_f, loss_mask=mask, dropped=dropped)
    return Correction(weight=weight, loss_mask=mask * keep_f, dropped=dropped)
