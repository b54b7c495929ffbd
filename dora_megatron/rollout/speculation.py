"""Speculative decoding: the policy (when to speculate) and the expected yield of a verify step.

WHY one pure module: the decision "speculate on this instance now?" is the engine's, and the
simulator must take the same decision on the same inputs, or its predictions describe another
engine. Both import this module (it depends on nothing of dora_megatron but the config's mode
names), so the embedded engine and ``dora simulate`` cannot drift apart.

Speculation pays where a decode step is memory-bound: verifying k+1 tokens of a request streams
the weights and the KV once, like a plain decode step, so at small batch a verify step costs about
one decode step and yields more than one token. At large batch the step is compute-bound, the
k+1 tokens cost about k+1 steps, and the rejected drafts are lost work; hence the batch threshold.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

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


#: The embedded engine's cumulative speculation counters (``/get_server_info``, ``/v1/loads``).
SPEC_COUNTERS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_tokens")


def speculation_summary(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The job summary's ``speculation``: the counters summed over instances (each instance's
    latest report), the draft tokens kept per verify step and the tokens a verify step yielded
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
