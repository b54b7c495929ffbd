"""Analytic cost model of a rollout instance: prefill, decode steps, weight and KV transfers.

WHY this shape: decode of a large model is memory-bound. One decode step streams the weights
once (fixed cost) plus the KV of every resident token (grows with the batch's total context);
only when the batch is large enough does the matmul time (``batch x per-sequence compute``)
exceed the memory time -- the roofline "knee". So per-step time grows slowly with batch until
the knee, then linearly. A request's time per output token is therefore nearly constant at
small batch, which is why the long tail cannot be shortened by adding instances, the effect the
DORA paper is built on.

Everything here is a pure function of :class:`~dora_megatron.config.sim.CostModelConfig` so the
event loop can *jump* an instance over many decode steps at once: ``decode_span_s`` is a closed
form of the sum of step times while the batch composition is fixed and the context grows by
``batch`` tokens per step, and ``decode_steps_within`` inverts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.sim import CostModelConfig


@dataclass(frozen=True)
class DecodeCost:
    """Coefficients of one decode step: ``t(b, C) = o + max(w + k*C, b*c)``."""

    overhead_s: float
    weight_s: float
    kv_s_per_token: float
    compute_s_per_seq: float

    @classmethod
    def from_config(cls, cfg: CostModelConfig) -> "DecodeCost":
        return cls(cfg.decode_step_overhead_s, cfg.decode_weight_read_s, cfg.decode_kv_read_s_per_token, cfg.decode_compute_s_per_seq)

    def step_s(self, batch: int, context_tokens: float) -> float:
        """Time of one decode step for ``batch`` sequences holding ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return self.overhead_s + max(self.weight_s + self.kv_s_per_token * context_tokens, batch * self.compute_s_per_seq)

    def knee_batch(self, context_tokens: float) -> float:
        """Batch at which compute time equals memory time for the given total context."""
        if self.compute_s_per_seq <= 0:
            return float("inf")
        return (self.weight_s + self.kv_s_per_token * context_tokens) / self.compute_s_per_seq

    def span_s(self, batch: int, context0: float, steps: int) -> float:
        """Total time of ``steps`` decode steps; the context grows by ``batch`` tokens per step.

        Step ``i`` (0-based) has context ``context0 + batch*i``. The memory term is linear in
        ``i`` and the compute term constant, so the sum of their maximum has a closed form.
        """
        if steps <= 0 or batch <= 0:
            return 0.0
        a = self.weight_s + self.kv_s_per_token * context0  # memory term at i = 0
        c = self.kv_s_per_token * batch  # memory term growth per step
        d = batch * self.compute_s_per_seq  # compute term
        n = steps
        # first index where memory >= compute: i* = ceil((d - a) / c)
        if a >= d:
            i_star = 0
        elif c <= 0:
            i_star = n
        else:
            i_star = min(n, max(0, -int(-(d - a) // c)))
        mem_sum = (n - i_star) * a + c * (n * (n - 1) - i_star * (i_star - 1)) / 2.0
        return n * self.overhead_s + i_star * d + mem_sum

    def steps_within(self, batch: int, context0: float, budget_s: float, max_steps: int) -> int:
        """Largest ``k <= max_steps`` with ``span_s(batch, context0, k) <= budget_s``."""
        if budget_s <= 0 or batch <= 0 or max_steps <= 0:
            return 0
        if self.span_s(batch, context0, max_steps) <= budget_s:
            return max_steps
        lo, hi = 0, max_steps  # span(lo) <= budget < span(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.span_s(batch, context0, mid) <= budget_s:
                lo = mid
            else:
                hi = mid
        return lo


def prefill_s(cfg: CostModelConfig, tokens: int) -> float:
    """Prefill time of one request of ``tokens`` input tokens."""
    return cfg.prefill_s_per_token * tokens + cfg.prefill_s_per_token2 * tokens * tokens


def kv_transfer_s(cfg: CostModelConfig, tokens: int) -> float:
    """Time to move one request's KV (``tokens`` resident tokens) to another instance."""
    return cfg.migration_latency_s + tokens * cfg.kv_bytes_per_token / cfg.migration_bandwidth_Bps
