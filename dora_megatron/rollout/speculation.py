"""Speculative decoding: the policy (when to speculate) and the expected yield of a verify step.

WHY one pure module: the decision "speculate on this instance now?" is the engine's, and the
simulator must take the same decision on the same inputs, or its predictions describe another
engine. Both import this module (it depends on nothing of dora_megatron but the config's mode
names), so the embedded engine and ``dora simulate`` cannot drift apart.

Speculation pays where a decode step is memory-bound: verifying k+1 tokens of a request streams
the weights and the KV once, like a plain decode step, so at small batch a verify step costs about
one decode step and yields more than one token. At large batch the step is compute-bound, the
k+1 tokens cost about k+1 steps, and the rejected drafts are lost work; hence the batch threshold.

Below the threshold the decision is per request (:func:`plan_draft`): a verify step pays only when
the tokens it is expected to yield exceed what it costs, and both depend on the request. Each
request keeps a running estimate of its per-token acceptance (:class:`DraftAcceptance`, updated by
:func:`observe_verify`), and drafts the length ``k`` that maximises expected tokens per unit of
step cost, ``E(k, alpha) / r(k)`` (:func:`draft_length_for_step`), ``r(k)`` being the cost of the
step in which each running request drafts ``k`` tokens relative to the plain step; no draft when
no ``k`` beats a plain step's 1. The embedded engine's ``r`` is linear in the step's positions,
each costing ``c = rollout.spec_token_cost`` of a lone decode step (:func:`batch_token_cost`): a
plain step of ``B`` requests costs ``1 + c(B - 1)`` and yields ``B`` tokens, so one draft token
costs ``c*B / (1 + c(B - 1))`` tokens' worth of that step, ``c`` alone, approaching 1 as the
batch grows (a draft token must then be kept nearly surely to pay). The length maximises the step's
rate when every running request drafts alike; for one request among plainly decoding ones the
draft-or-not threshold is the same, the best length sometimes one longer. The running batch
counts requests still prefilling, which errs towards not drafting. The simulator's ``r`` is its
per-step roofline (``sim/cost.py``), flat while decode is memory-bound.
A request that stopped drafting probes again every ``rollout.spec_probe_interval`` decode steps,
because its text may turn repetitive later and an estimate without new evidence never moves. The
policy decides only whether and how long to draft, never what is kept: exactness is the verify
rule's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from dora_megatron.config.rollout import SPEC_MODES


def expected_tokens_per_verify(spec_tokens: int, acceptance: float) -> float:
    """Expected tokens a request gains per verify step with a draft of ``spec_tokens`` tokens.

    Each draft token is accepted with probability ``acceptance`` (alpha), independently, until
    the first rejection; the verify pass then contributes one token of its own (the corrected
    token at the rejection, or the bonus token after a fully accepted draft). The count is
    ``1 + min(k, N)`` with ``N`` geometric, whose mean is ``(1 - alpha^(k+1)) / (1 - alpha)``
    (Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding",
    ICML 2023, eq. 1). ``alpha = 1`` gives ``k + 1``; ``alpha = 0`` gives 1 (the verify pass's own
    token: speculation then only costs).
    """
    if spec_tokens < 0:
        raise ValueError(f"spec_tokens must be >= 0, got {spec_tokens}")
    if not 0.0 <= acceptance <= 1.0 or math.isnan(acceptance):
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance >= 1.0:
        return float(spec_tokens + 1)
    return (1.0 - acceptance ** (spec_tokens + 1)) / (1.0 - acceptance)


def should_speculate(mode: str, running_batch: int, spec_max_batch: int) -> bool:
    """The engine's policy: speculate when it is on (``ngram`` or ``group``) and the instance's
    running batch is non-empty and at most ``spec_max_batch`` (``rollout.spec_max_batch``)."""
    if mode not in SPEC_MODES:
        raise ValueError(f"rollout.speculative must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
    return mode != "off" and 0 < running_batch <= spec_max_batch


#: The acceptance estimate's prior, as pseudo-observations: half a draft token kept in one tried.
#: WHY light: a new request tries drafting once whatever the prior says (:func:`plan_draft`), and
#: one pseudo-trial lets that first verify step decide: a draft rejected at its first token stops
#: drafting (each needless verify step is a loss where drafts are poor), one kept whole raises the
#: draft length at once.
PRIOR_ACCEPTED = 0.5
PRIOR_TRIALS = 1.0
#: Weight of the past per verify step (exponential forgetting): evidence about 10 verify steps old
#: counts ~1/3. WHY forget: a request's text changes character (a restated sub-result, a fresh
#: derivation), and the estimate must follow within a few probes.
ACCEPTANCE_DECAY = 0.9


@dataclass(frozen=True)
class DraftAcceptance:
    """One request's running evidence about its drafts: the (decayed) draft tokens accepted and
    the (decayed) draft tokens tried, a token being tried until the first rejection, plus the
    decode steps since its last verify step (which time its next probe)."""

    accepted: float = 0.0
    trials: float = 0.0
    steps_since_verify: int = 0

    @property
    def alpha(self) -> float:
        """The per-token acceptance estimate: the prior and the decayed evidence pooled."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def to_json(self) -> list[float]:
        return [self.accepted, self.trials, float(self.steps_since_verify)]

    @classmethod
    def from_json(cls, raw: Any) -> "DraftAcceptance":
        """The inverse of :meth:`to_json` for a migrated request; ``ValueError`` names the fault."""
        if (not isinstance(raw, list) or len(raw) != 3
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 for x in raw)
                or raw[0] > raw[1] or math.isinf(raw[1])):
            raise ValueError(f"spec_acceptance must be [accepted, trials, steps] with 0 <= accepted <= trials, got {str(raw)[:80]}")
        return cls(float(raw[0]), float(raw[1]), int(raw[2]))


def draft_length_for_step(acceptance: float, max_tokens: int, relative_cost: Callable[[int], float]) -> int:
    """The draft length in ``0..max_tokens`` that maximises expected tokens per unit of step cost,
    ``expected_tokens_per_verify(k, acceptance) / relative_cost(k)``, where ``relative_cost(k)``
    is the step's cost with ``k`` draft tokens per running request over its cost without
    (``relative_cost(0) == 1``); 0 (a plain decode step, 1 token per unit) unless some ``k`` does
    strictly better. Ties go to the shorter draft."""
    best, best_rate = 0, 1.0
    for k in range(1, max_tokens + 1):
        rate = expected_tokens_per_verify(k, acceptance) / relative_cost(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def batch_token_cost(token_cost: float, running_batch: int) -> float:
    """What one draft token costs, in tokens of a plain step of ``running_batch`` requests, when
    every position of a step costs ``token_cost`` of a lone decode step: ``c*B / (1 + c(B - 1))``
    (the plain step costs ``1 + c(B - 1)`` for ``B`` tokens). WHY: the draft tokens of one request
    delay every request of the step; at ``B = 1`` this is ``c`` itself."""
    if token_cost < 0 or math.isnan(token_cost):
        raise ValueError(f"spec_token_cost must be >= 0, got {token_cost}")
    if running_batch < 1:
        raise ValueError(f"running batch must be >= 1, got {running_batch}")
    return token_cost * running_batch / (1.0 + token_cost * (running_batch - 1))


def best_draft_length(acceptance: float, max_tokens: int, token_cost: float, running_batch: int = 1) -> int:
    """:func:`draft_length_for_step` under the embedded engine's linear step cost: each draft token
    costs :func:`batch_token_cost` of the plain step, ``E(k, acceptance) / (1 + c_B * k)``."""
    c = batch_token_cost(token_cost, running_batch)
    return draft_length_for_step(acceptance, max_tokens, lambda k: 1.0 + c * k)


def plan_draft(state: DraftAcceptance, max_tokens: int, token_cost: float, probe_interval: int,
               running_batch: int = 1) -> int:
    """How many draft tokens a decoding request gets this step (0: a plain decode step), at the
    instance's ``running_batch``.

    ``max_tokens`` is the longest draft allowed now (``spec_tokens``, capped by the request's
    remaining budget). Where the estimate says drafting does not pay, the request still drafts
    ``max_tokens`` once it has gone ``probe_interval`` decode steps without a verify step: a
    bounded probe (at most one verify step in ``probe_interval + 1``) that lets the estimate see
    text that turned repetitive. A request that has never been verified probes at once: at a large
    batch the prior alone would not pay, and a request that never tries never learns that its
    drafts are good.
    """
    if max_tokens <= 0:
        return 0
    k = best_draft_length(state.alpha, max_tokens, token_cost, running_batch)
    if k == 0 and (state.steps_since_verify >= probe_interval or state.trials == 0):
        return max_tokens  # a probe; a request with no evidence yet probes at once, at any batch
    return k


def observe_verify(state: DraftAcceptance, drafted: int, accepted: int, rejected: bool) -> DraftAcceptance:
    """The estimate after a verify step that drafted ``drafted`` tokens, kept the first
    ``accepted`` and (``rejected``) saw the next one refused. The tries are the accepted tokens
    plus the rejection, if one was seen: tokens after it were never tried (the per-token model of
    :func:`expected_tokens_per_verify`), and a request that ended inside an accepted run saw none."""
    if not 0 <= accepted <= drafted or (rejected and accepted == drafted):
        raise ValueError(f"a verify step of {drafted} draft tokens cannot accept {accepted} (rejected={rejected})")
    tries = accepted + (1 if rejected else 0)
    return DraftAcceptance(ACCEPTANCE_DECAY * state.accepted + accepted, ACCEPTANCE_DECAY * state.trials + tries, 0)


def observe_decode(state: DraftAcceptance) -> DraftAcceptance:
    """The state after a decode step in which the request could have drafted and did not."""
    return replace(state, steps_since_verify=state.steps_since_verify + 1)


#: The embedded engine's cumulative speculation counters (``/get_server_info``, ``/v1/loads``).
SPEC_COUNTERS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_tokens",
                 "spec_scored_tokens", "spec_recorded_sources")


def counter_growth(last: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, int]:
    """How much each speculation counter of one instance grew between two of its reports. A counter
    below its last value means the instance was restarted (its counters start again at 0): then all
    of ``now`` is new. WHY: the job's totals are the sum of these growths, so a restart loses nothing
    that was reported before it."""
    out: dict[str, int] = {}
    for k in SPEC_COUNTERS:
        n, p = int(now.get(k, 0) or 0), int(last.get(k, 0) or 0)
        out[k] = n - p if n >= p else n
    return out


def speculation_summary(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The job summary's ``speculation``: the counters summed over ``stats`` (the runtime passes its
    run totals, :func:`counter_growth` summed over every instance's reports), the draft tokens kept per verify step and the tokens a verify step yielded
    (the simulator's :func:`expected_tokens_per_verify`, measured). A verify step counts once
    per request that speculated in a forward pass."""
    out: dict[str, Any] = {k: 0 for k in SPEC_COUNTERS}
    for s in stats:
        for k in SPEC_COUNTERS:
            out[k] += int(s.get(k, 0) or 0)
    steps = out["spec_verify_steps"]
    out["accepted_tokens_per_step"] = out["spec_accepted_tokens"] / steps if steps else 0.0
    out["tokens_per_verify_step"] = out["spec_verify_tokens"] / steps if steps else 0.0
    return out
