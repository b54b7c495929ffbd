"""The C1 version guard on an engine's answer: which weight versions sampled its output tokens.

Both real engines label output tokens with the weights that sampled them (``weight_versions``
spans: SGLang >= 0.5.22 in ``meta_info``, vLLM 0.32 in ``choices[0]``), and both adapters decide
with :func:`span_problem` whether an answer may be counted for the version it was routed for.
"""

from __future__ import annotations

from typing import Sequence

#: ``(version label, first output token, end)`` of one span, ``end`` exclusive
Span = tuple[str, int, int]


def span_problem(spans: Sequence[Span], n_tokens: int, expected: str, *, updates_in_flight: bool) -> str | None:
    """Why an answer's spans do not let its ``n_tokens`` output tokens count for version ``expected``
    (None: they do).

    The rule, and why it has two cases:

    * The first span must always be ``expected``: an answer that began on other weights was never
      sampled by the policy the request was routed for (its behaviour log-probs belong to another
      version), so none of it may count; the runtime runs the sample again (C1 stays exact).
    * ``updates_in_flight=True`` (SGLang with ``sglang.pause_mode`` ``retract``/``in_place``): the
      engine switches weights *under* running requests on purpose, so later spans may show newer
      versions; the answer is kept and the runtime records every version in its spans
      (:attr:`~dora_megatron.comm.protocol.GenerateResponse.versions_used`). Only the first
      span is checked, and an answer without spans stands for its echoed version.
    * ``updates_in_flight=False`` (vLLM: the adapter switches only an empty, paused instance):
      every output token must be shown to come from ``expected``, so the spans must cover tokens
      ``0..n_tokens`` contiguously and all carry ``expected``; any other label means a switch
      raced the request. An answer without tokens has nothing to count and needs no span.
    """
    ordered = sorted(spans, key=lambda s: s[1])
    if updates_in_flight:
        if not ordered:
            return "no weight version reported"
        if ordered[0][0] != expected:
            return f"started on weights {ordered[0][0]!r}, not {expected!r} (ran on {'+'.join(s[0] for s in ordered)!r})"
        return None
    if n_tokens == 0:
        return None
    if not ordered:
        return f"{n_tokens} output tokens without weight_versions spans"
    pos = 0
    for version, start, end in ordered:
        if start != pos or end <= start:
            return f"weight_versions spans are not contiguous at token {pos}: {list(spans)}"
        if version != expected:
            return f"tokens {start}..{end} were sampled by weights {version!r}, not {expected!r}"
        pos = end
    if pos != n_tokens:
        return f"weight_versions spans cover {pos} of {n_tokens} output tokens"
    return None
