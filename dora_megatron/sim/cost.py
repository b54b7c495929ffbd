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

Host KV tier (``cost.host_kv_capacity_tokens > 0``, the paper's KV offload): an instance admits
requests until device + host KV is full instead of stopping at device KV. The context beyond
``kv_capacity_tokens`` lives in host memory and its KV is streamed to the device every decode step
over the host link, layer by layer and overlapped with the HBM reads, so a step costs
``o + max(w + k*C_dev, h*C_host, b*c)`` with ``h = kv_bytes_per_token / host_kv_bandwidth_Bps``.
Spilling is free while the host stream hides under the HBM time and slows every step beyond
that point, which is why the tier pays only where the link is fast compared to the KV per token
(:func:`host_kv_hidden_tokens`).

Speculative decoding (``rollout.speculative != off``, :class:`DecodeModel`): while the engine's
policy says so for the instance's running batch, each step is a *verify* step: every running
request feeds k+1 tokens, so the step
costs the per-step model with the batch's tokens multiplied by k+1 (the compute term ``b*(k+1)*c``;
the weights and the resident KV are read once, as in a decode step) plus
``cost.spec_verify_overhead_s``, and yields ``E = expected_tokens_per_verify(k, alpha)`` tokens per
request. The simulator keeps counting one token per request per "step" and charges each token
``verify_s / E``, i.e. a :class:`DecodeCost` whose coefficients are divided by ``E``: the closed
forms above hold unchanged. This is a fluid model: a request's accepted count is taken at its mean
(over the thousands of verify steps of a long request the sum concentrates on it), so the
variance of single requests is not simulated.

The draft length is the engine's decision (:func:`~dora_megatron.rollout.speculation.draft_length_for_step`:
the length that maximises expected tokens per unit of step cost) taken per running batch at the
drafter's true acceptance, the value the engine's running estimate converges to, with the step
cost of this model (:meth:`DecodeCost.verify_relative_s`: a verify step is nearly free while the
batch's k+1 tokens per request stay under the compute knee) or, where ``rollout.spec_token_cost``
is set, the embedded engine's linear cost. Where no draft pays the simulated instance decodes
plainly, as the engine does once its requests stop drafting (the engine's probes, one verify step
in ``spec_probe_interval + 1``, are not charged).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dora_megatron.config.sim import CostModelConfig, SimRolloutConfig
from dora_megatron.rollout.speculation import (
    best_draft_length,
    draft_length_for_step,
    expected_tokens_per_verify,
    should_speculate,
)


@dataclass(frozen=True)
class DecodeCost:
    """Coefficients of one decode step: ``t(b, C) = o + max(w + k*C, b*c)`` without a host tier,
    ``o + max(w + k*min(C, D), h*max(0, C - D), b*c)`` with one (``D = device_kv_tokens``)."""

    overhead_s: float
    weight_s: float
    kv_s_per_token: float
    compute_s_per_seq: float
    device_kv_tokens: float = math.inf  # context beyond this is in the host tier
    host_s_per_token: float = 0.0  # per decode step and spilled token: host-link time

    @classmethod
    def from_config(cls, cfg: CostModelConfig) -> "DecodeCost":
        tier = cfg.host_kv_capacity_tokens > 0
        return cls(cfg.decode_step_overhead_s, cfg.decode_weight_read_s, cfg.decode_kv_read_s_per_token,
                   cfg.decode_compute_s_per_seq,
                   device_kv_tokens=float(cfg.kv_capacity_tokens) if tier else math.inf,
                   host_s_per_token=cfg.kv_bytes_per_token / cfg.host_kv_bandwidth_Bps if tier else 0.0)

    @property
    def has_host_tier(self) -> bool:
        return self.host_s_per_token > 0 and math.isfinite(self.device_kv_tokens)

    def spill_s(self, context_tokens: float) -> float:
        """Host-link time of one decode step: the KV beyond device capacity, streamed in."""
        if not self.has_host_tier:
            return 0.0
        return self.host_s_per_token * max(0.0, context_tokens - self.device_kv_tokens)

    def step_s(self, batch: int, context_tokens: float) -> float:
        """Time of one decode step for ``batch`` sequences holding ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        device = min(context_tokens, self.device_kv_tokens)
        return self.overhead_s + max(self.weight_s + self.kv_s_per_token * device, self.spill_s(context_tokens),
                                     batch * self.compute_s_per_seq)

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
        if self.has_host_tier:
            return self._tiered_span_s(batch, context0, steps)
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

    def _tiered_span_s(self, batch: int, context0: float, steps: int) -> float:
        """``span_s`` with a host tier: the steps before the context passes device capacity have
        memory term ``w + k*C``, the steps after it ``max(w + k*D, h*(C - D))``; both segments are
        sums of ``max(linear, constant)``, each in closed form."""
        dev = self.device_kv_tokens
        d = batch * self.compute_s_per_seq
        # first step index whose context exceeds device capacity
        i_dev = 0 if context0 > dev else min(steps, int((dev - context0) // batch) + 1)
        head = _sum_max_linear(self.weight_s + self.kv_s_per_token * context0, self.kv_s_per_token * batch, d, 0, i_dev)
        floor = max(self.weight_s + self.kv_s_per_token * dev, d)
        tail = _sum_max_linear(self.host_s_per_token * (context0 - dev), self.host_s_per_token * batch, floor, i_dev, steps)
        return steps * self.overhead_s + head + tail

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


    def dual(self) -> "DecodeCost":
        """A decode step of an instance that runs requests of two versions (``orchestrator.dual_version``):
        one forward per version's batch, so the step overhead and the weight read are paid twice; the
        KV and the per-sequence compute are those of the two batches together. Exact when both
        batches are memory-bound (a tail is a few requests); where one is compute-bound it
        undercounts by at most that batch's weight read."""
        return dataclasses.replace(self, overhead_s=2 * self.overhead_s, weight_s=2 * self.weight_s)

    def verify_relative_s(self, batch: int, spec_tokens: int, verify_overhead_s: float) -> float:
        """A verify step of ``batch`` requests with ``spec_tokens`` draft tokens each over a plain
        decode step of that batch, both at zero context (:meth:`verify` at acceptance 0 costs the
        verify step itself: one token each). WHY zero context: the resident KV adds the same memory
        time to both steps, which only lowers this ratio, so a draft length that pays here pays at
        any context (the decision is conservative and fixed per batch, which keeps the closed forms
        of :meth:`span_s` valid)."""
        plain = self.step_s(batch, 0.0)
        verify = self.verify(spec_tokens, 0.0, verify_overhead_s).step_s(batch, 0.0)
        if plain <= 0:  # a free decode step (a degenerate config): drafts pay only if verifying is free too
            return 1.0 if verify <= 0 else math.inf
        return verify / plain

    def verify(self, spec_tokens: int, acceptance: float, verify_overhead_s: float) -> "DecodeCost":
        """Cost per generated token of verify steps (draft length ``spec_tokens``, per-token
        acceptance ``acceptance``) as a :class:`DecodeCost` in the same units as this one: one
        "step" advances every running request by one token and costs a verify step over ``E``."""
        e = expected_tokens_per_verify(spec_tokens, acceptance)
        return DecodeCost((self.overhead_s + verify_overhead_s) / e, self.weight_s / e, self.kv_s_per_token / e,
                          self.compute_s_per_seq * (spec_tokens + 1) / e, device_kv_tokens=self.device_kv_tokens,
                          host_s_per_token=self.host_s_per_token / e)


@dataclass(frozen=True)
class DecodeModel:
    """The decode cost an instance pays at a given running batch: plain decode steps, or verify
    steps of the draft length the engine's policy chooses at that batch."""

    plain: DecodeCost
    mode: str = "off"
    acceptance: float = 0.0  # the drafter's per-token acceptance (cost.spec_acceptance.<mode>)
    drafts: tuple[int, ...] = ()  # draft length at running batch b = index + 1 (0: plain steps); () when off,
    # up to min(spec_max_batch, cost.max_concurrent)
    verify_costs: tuple[DecodeCost | None, ...] = ()  # per-token cost of those verify steps, by batch

    @classmethod
    def from_config(cls, cost: CostModelConfig, rollout: SimRolloutConfig | None = None) -> "DecodeModel":
        plain = DecodeCost.from_config(cost)
        if rollout is None or rollout.speculative == "off":
            return cls(plain)
        alpha = getattr(cost.spec_acceptance, rollout.speculative)
        overhead = cost.spec_verify_overhead_s
        most = min(rollout.spec_max_batch, cost.max_concurrent)  # an instance never runs more (cost.max_concurrent)
        drafts = tuple(cls._draft_length(plain, b, alpha, rollout, overhead) for b in range(1, most + 1))
        return cls(plain, rollout.speculative, alpha, drafts,
                   tuple(plain.verify(k, alpha, overhead) if k else None for k in drafts))

    @staticmethod
    def _draft_length(plain: DecodeCost, batch: int, acceptance: float, rollout: SimRolloutConfig,
                      verify_overhead_s: float) -> int:
        """The engine's policy at running batch ``batch``: off above ``rollout.spec_max_batch``
        (:func:`~dora_megatron.rollout.speculation.should_speculate`), else the draft length that
        maximises tokens per unit of step cost (:func:`~dora_megatron.rollout.speculation.draft_length_for_step`)
        with the instance's own step cost (:meth:`DecodeCost.verify_relative_s`), or, where
        ``rollout.spec_token_cost`` is set, with the embedded engine's linear one."""
        if not should_speculate(rollout.speculative, batch, rollout.spec_max_batch):
            return 0
        if rollout.spec_token_cost is not None:
            return best_draft_length(acceptance, rollout.spec_tokens, rollout.spec_token_cost, batch)
        return draft_length_for_step(acceptance, rollout.spec_tokens,
                                     lambda k: plain.verify_relative_s(batch, k, verify_overhead_s))

    def draft_tokens_at(self, batch: int) -> int:
        """The draft length of each request at this running batch (0: plain decode steps)."""
        return self.drafts[batch - 1] if 1 <= batch <= len(self.drafts) else 0

    def speculates(self, batch: int) -> bool:
        return self.draft_tokens_at(batch) > 0

    def for_batch(self, batch: int) -> DecodeCost:
        """The per-token cost model in force while ``batch`` requests run."""
        return self.verify_costs[batch - 1] if self.speculates(batch) else self.plain  # type: ignore[return-value]

    @property
    def spec(self) -> DecodeCost | None:
        """The lone request's verify cost (the tail's), None where it decodes plainly."""
        return self.for_batch(1) if self.speculates(1) else None

    @property
    def draft_tokens(self) -> int:
        return self.draft_tokens_at(1)

    @property
    def tokens_per_verify(self) -> float:
        """E of the lone request's verify steps (1.0 where it does not speculate)."""
        return expected_tokens_per_verify(self.draft_tokens, self.acceptance) if self.draft_tokens else 1.0

    @property
    def largest_speculating_batch(self) -> int:
        return max((b for b in range(1, len(self.drafts) + 1) if self.drafts[b - 1]), default=0)


def prefill_s(cfg: CostModelConfig, tokens: int) -> float:
    """Prefill time of one request of ``tokens`` input tokens."""
    return cfg.prefill_s_per_token * tokens + cfg.prefill_s_per_token2 * tokens * tokens


def kv_transfer_s(cfg: CostModelConfig, tokens: int) -> float:
    """Time to move one request's KV (``tokens`` resident tokens) to another instance."""
    return cfg.migration_latency_s + tokens * cfg.kv_bytes_per_token / cfg.migration_bandwidth_Bps


def _sum_max_linear(a: float, c: float, d: float, i0: int, i1: int) -> float:
    """``sum(max(a + c*i, d) for i in range(i0, i1))`` in closed form (``c >= 0``)."""
    if i1 <= i0:
        return 0.0
    if a + c * i0 >= d:
        i_star = i0
    elif c <= 0:
        i_star = i1
    else:
        i_star = min(i1, max(i0, math.ceil((d - a) / c)))
    return (i_star - i0) * d + (i1 - i_star) * a + c * (i1 * (i1 - 1) - i_star * (i_star - 1)) / 2.0


def host_kv_spill_s(cfg: CostModelConfig, context_tokens: float) -> float:
    """Host-link time one decode step of an instance holding ``context_tokens`` pays for its
    spilled KV (0 without a tier or below device capacity)."""
    return DecodeCost.from_config(cfg).spill_s(context_tokens)


def host_kv_hidden_tokens(cfg: CostModelConfig) -> float:
    """Spilled tokens whose stream hides under a full device's HBM time (the useful tier size)."""
    if cfg.host_kv_capacity_tokens <= 0:
        return 0.0
    h = cfg.kv_bytes_per_token / cfg.host_kv_bandwidth_Bps
    return (cfg.decode_weight_read_s + cfg.decode_kv_read_s_per_token * cfg.kv_capacity_tokens) / h


def kv_admit_tokens(cfg: CostModelConfig) -> int:
    """KV tokens an instance admits requests into: device capacity plus the host tier."""
    return cfg.kv_capacity_tokens + cfg.host_kv_capacity_tokens
