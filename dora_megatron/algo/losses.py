"""GRPO-family token-level policy losses as pure functions of per-token tensors.

WHY: the loss must be checkable by hand and independent of Megatron. The trainer calls
:func:`policy_loss` once per micro-batch and gets back a *sum* and an integer *denominator*; the
Megatron schedule adds numerators and denominators over micro-batches and data-parallel ranks
(``calculate_per_token_loss``) so the normalisation is exact for the whole global batch
whatever the micro-batching: ``token_mean`` divides by all tokens, ``seq_mean`` by the number of
samples after averaging within each sample, ``constant`` (Dr.GRPO) by
``num_samples * length_norm_constant``.

Per-token terms (A = advantage of the token's sample, r = exp(logp - old_logp) where old_logp are
the sample's own behaviour log-probs):

* clipped surrogate ``max(-A r, -A clip(r, 1-lo, 1+hi))`` with (lo, hi) chosen by the sign of A
  (triplet clipping), and for A<0 the dual-clip bound ``min(., -A c)``;
* rollout correction (:mod:`dora_megatron.algo.correction`): truncated importance sampling weight
  ``min(exp(trainer_lp - rollout_lp), tis_cap)`` (detached) and/or masked IS (token or sequence
  level) / IcePop masking of tokens whose trainer/rollout ratio leaves a band;
* optional entropy bonus ``-entropy_coef * H``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dora_megatron.algo.correction import CorrectionSettings, rollout_correction

if TYPE_CHECKING:
    from dora_megatron.config.algo import AlgoConfig


@dataclass(frozen=True)
class ClipBounds:
    """Ratio bounds: r in [1 - low, 1 + high], chosen by the sign of the advantage."""

    pos_low: float = 0.2
    pos_high: float = 0.2
    neg_low: float = 0.2
    neg_high: float = 0.2
    dual_clip_c: float = 0.0  # 0 disables; else loss <= c * |A| for A < 0


@dataclass(frozen=True)
class LossSettings:
    """Everything :func:`policy_loss` needs besides tensors (built from ``AlgoConfig``)."""

    bounds: ClipBounds = field(default_factory=ClipBounds)
    tis_cap: float = 0.0
    length_norm: str = "token_mean"
    length_norm_constant: int = 0
    entropy_coef: float = 0.0
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)

    @property
    def needs_trainer_logprobs(self) -> bool:
        """True when the loss compares recomputed trainer log-probs with the rollout's."""
        return self.tis_cap > 0 or self.correction.mode != "none"


@dataclass
class LossOutput:
    """``loss_sum / denominator`` is the loss; ``metric_sums`` are token sums (divide by ``num_tokens``).

    ``num_tokens`` counts every response token; ``denominator`` counts what the loss is normalised
    by, which excludes tokens/samples a masked-IS correction dropped."""

    loss_sum: torch.Tensor
    denominator: int
    num_tokens: int
    metric_sums: dict[str, torch.Tensor]

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / max(self.denominator, 1)


def settings_from_config(cfg: AlgoConfig) -> LossSettings:
    """Map an ``AlgoConfig`` to :class:`LossSettings` (``loss`` picks the clip bounds)."""
    if cfg.loss == "ppo_clip":
        bounds = ClipBounds(cfg.clip_eps_low, cfg.clip_eps_high, cfg.clip_eps_low, cfg.clip_eps_high, 0.0)
    elif cfg.loss == "triplet_clip":
        bounds = ClipBounds(cfg.triplet_pos_low, cfg.triplet_pos_high, cfg.triplet_neg_low, cfg.triplet_neg_high,
                            cfg.dual_clip_c)
    else:
        raise KeyError(f"unknown policy loss {cfg.loss!r}")
    correction = CorrectionSettings(mode=cfg.rollout_correction, low=cfg.correction_low,
                                    high=cfg.correction_high, seq_agg=cfg.seq_mis_agg, tis_cap=cfg.tis_cap)
    return LossSettings(bounds=bounds, tis_cap=cfg.tis_cap, length_norm=cfg.length_norm,
                        length_norm_constant=cfg.length_norm_constant,
                        entropy_coef=cfg.entropy_coef, correction=correction)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, b: ClipBounds) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped loss and a bool tensor marking tokens whose gradient was clipped away."""
    pos = adv >= 0
    low = torch.where(pos, torch.full_like(ratio, 1 - b.pos_low), torch.full_like(ratio, 1 - b.neg_low))
    high = torch.where(pos, torch.full_like(ratio, 1 + b.pos_high), torch.full_like(ratio, 1 + b.neg_high))
    unclipped = -adv * ratio
    clipped = -adv * torch.minimum(torch.maximum(ratio, low), high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if b.dual_clip_c > 0:
        bound = -adv * b.dual_clip_c
        dual = (~pos) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, settings: LossSettings, *, rollout_logprobs: torch.Tensor | None = None,
                trainer_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, on_policy: torch.Tensor | None = None) -> LossOutput:
    """Token-level GRPO-family loss for one micro-batch.

    Shapes: ``[B, T]`` per-token tensors; ``advantages`` ``[B]`` (broadcast over tokens) or ``[B, T]``;
    ``mask`` 1 on response tokens. ``old_logprobs`` are the behaviour log-probs (the version that
    generated each sample). TIS uses ``trainer_logprobs`` (detached trainer recompute; defaults to
    ``old_logprobs``) against ``rollout_logprobs``.

    ``rollout_vs_trainer_logprob_diff`` compares the engine's log-probs with the trainer's only on
    samples generated by the weights being trained (``on_policy`` ``[B]`` bool, default all):
    a stale sample differs by the policy change, not by an engine/trainer mismatch. Its token
    count is ``on_policy_tokens``.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    advantages = advantages.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    per_token, was_clipped = clipped_surrogate(ratio, advantages, settings.bounds)
    metrics: dict[str, torch.Tensor] = {}
    loss_mask = mask
    if settings.needs_trainer_logprobs and rollout_logprobs is not None:
        base = (trainer_logprobs if trainer_logprobs is not None else old_logprobs).detach()
        corr = rollout_correction(base, rollout_logprobs, mask,
                                  CorrectionSettings(**{**settings.correction.__dict__, "tis_cap": settings.tis_cap}))
        per_token = per_token * corr.weight
        loss_mask = corr.loss_mask
        if settings.tis_cap > 0:
            metrics["tis_weight"] = (corr.weight * mask).sum().detach()
        if settings.correction.mode != "none":
            metrics["correction_dropped_fraction"] = corr.dropped.sum().detach()
    metrics["pg_loss"] = (per_token * loss_mask).sum().detach()
    if entropy is not None:
        metrics["entropy"] = (entropy * mask).sum().detach()
        if settings.entropy_coef > 0:
            per_token = per_token - settings.entropy_coef * entropy
    metrics["clip_fraction"] = (was_clipped.to(mask.dtype) * mask).sum().detach()
    metrics["approx_kl_behaviour"] = ((-log_ratio).detach() * mask).sum()
    if rollout_logprobs is not None:
        fresh = mask if on_policy is None else mask * on_policy.to(mask.dtype)[:, None]
        metrics["rollout_vs_trainer_logprob_diff"] = ((logprobs.detach() - rollout_logprobs).abs() * fresh).sum()
        metrics["on_policy_tokens"] = fresh.sum().detach()
    masked = per_token * loss_mask
    num_tokens = int(mask.sum().item())
    kept_tokens = int(loss_mask.sum().item())
    num_samples = int((loss_mask.sum(-1) > 0).sum().item())
    if settings.length_norm == "token_mean":
        loss_sum, denom = masked.sum(), kept_tokens
    elif settings.length_norm == "seq_mean":
        loss_sum = (masked.sum(-1) / loss_mask.sum(-1).clamp(min=1)).sum()
        denom = num_samples
    elif settings.length_norm == "constant":
        if settings.length_norm_constant <= 0:
            raise ValueError("length_norm=constant needs length_norm_constant > 0")
        loss_sum = masked.sum() / settings.length_norm_constant
        denom = num_samples
    else:
        raise KeyError(f"unknown length_norm {settings.length_norm!r}")
    return LossOutput(loss_sum=loss_sum, denominator=denom, num_tokens=num_tokens, metric_sums=metrics)
