"""Draft tokens for speculative decoding by suffix (n-gram) matching, without a draft model.

WHY n-gram matching: RL rollouts repeat themselves (code, restated sub-results, the prompt's own
phrases), and the responses of one group answer the same prompt with the same weights, so the
text that followed the request's last few tokens elsewhere is a cheap, often right guess of what
follows now. A wrong guess costs only the verify positions it took: the verify rule
(:func:`dora_megatron.rollout.engine.sampler.verify_draft`) keeps the sampling distribution exact
whatever the draft.

The search: for n from ``max_ngram`` down to ``min_ngram``, the last n tokens of the context are
looked up in the sources (the group's finished siblings' outputs, see :func:`sibling_source`);
failing that, in the context itself (excluding its own end). The most recent occurrence with a
continuation wins, and up to ``k`` tokens that followed it are the draft. Longer matches predict
better, hence the descending n; a sibling's output answers the same prompt at the same point, so
any match there beats a longer one in the prompt (whose continuation is prompt text, not answer).
"""

from __future__ import annotations

from typing import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 1


def _continuation(seq: Sequence[int], pattern: Sequence[int], k: int) -> list[int]:
    """Up to ``k`` tokens after the most recent occurrence of ``pattern`` in ``seq`` that has a
    continuation (so a context's own suffix, which has none, never matches itself)."""
    n = len(pattern)
    tail = pattern[-1]
    for end in range(len(seq) - 1, n - 1, -1):  # end: index just after the occurrence
        if seq[end - 1] == tail and list(seq[end - n : end]) == list(pattern):
            return list(seq[end : end + k])
    return []


def propose_draft(
    context: Sequence[int],
    k: int,
    sources: Sequence[Sequence[int]] = (),
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = MIN_NGRAM,
) -> list[int]:
    """A draft of at most ``k`` tokens to follow ``context`` (empty when nothing matches)."""
    if k <= 0 or not context:
        return []
    ngrams = range(min(max_ngram, len(context)), min_ngram - 1, -1)
    for n in ngrams:
        for src in sources:
            draft = _continuation(src, context[-n:], k)
            if draft:
                return draft
    for n in ngrams:
        draft = _continuation(context, context[-n:], k)
        if draft:
            return draft
    return []


def sibling_source(prompt: Sequence[int], sequence: Sequence[int], max_ngram: int = MAX_NGRAM) -> list[int]:
    """What to keep of a sibling's ``sequence`` (prompt + output): its output and the last
    ``max_ngram - 1`` tokens of the shared prompt before it, so matches may straddle the start of
    the answer, while the prompt itself (the request's own context already) is not searched twice."""
    cut = len(prompt) if list(sequence[: len(prompt)]) == list(prompt) else 0
    return list(sequence[max(0, cut - (max_ngram - 1)) :])
