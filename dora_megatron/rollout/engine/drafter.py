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

Sampled drafts (:class:`SiblingIndex`, ``speculative: group`` at a temperature above zero): a
deterministic draft token ``d`` is kept with probability ``p(d)``, which at temperature 1 is low
even when the siblings guessed the likeliest token. Drawing the draft from a distribution ``q`` and
keeping it with probability ``min(1, p(d) / q(d))`` (the general rule) keeps it with probability
``sum(min(p, q))`` instead, which is higher whenever ``q`` spreads its mass the way ``p`` does.
The siblings give such a ``q``: what followed the request's last n tokens across every finished
sibling, at every n that matches, averaged over n. Measured on the main job's model (lone long-tail
requests at temperature 1, the first draft token): kept with probability 0.27 as a deterministic
draft, 0.42 when drawn from that ``q``.
"""

from __future__ import annotations

from typing import Sequence

import torch

MAX_NGRAM = 4
MIN_NGRAM = 1
#: occurrences looked at per source and match level (the most recent): bounds a draft's cost on
#: long sources with frequent tokens; drafts only set speed, never what is sampled. The matches
#: of two tokens or more are found through the last two tokens, so a frequent last token (a space,
#: a newline) does not crowd out the occurrences that match the context further back.
MAX_OCCURRENCES = 64


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


class SiblingIndex:
    """The positions of every token in a request's sibling sources, for drawing sampled drafts.

    Built once per set of sources (a request's ``draft_sources`` change only when siblings finish),
    it holds one list of positions per distinct token and source: memory linear in the sources'
    length, unlike an n-gram table."""

    def __init__(self, sources: Sequence[Sequence[int]], max_ngram: int = MAX_NGRAM) -> None:
        self.sources = [list(src) for src in sources]
        self.max_ngram = max_ngram
        self.positions: list[dict[int, list[int]]] = []  # token -> where it occurs
        self.pair_positions: list[dict[tuple[int, int], list[int]]] = []  # (previous, token) -> where token occurs
        for src in self.sources:
            where: dict[int, list[int]] = {}
            pairs: dict[tuple[int, int], list[int]] = {}
            for i, t in enumerate(src[:-1]):  # a token with no continuation predicts nothing
                where.setdefault(t, []).append(i)
                if i > 0:
                    pairs.setdefault((src[i - 1], t), []).append(i)
            self.positions.append(where)
            self.pair_positions.append(pairs)

    def next_distribution(self, context: Sequence[int]) -> dict[int, float] | None:
        """``q``: for each n in 1..max_ngram that matches, the tokens that followed the context's
        last n tokens in the sources, as shares of that n's matches; averaged over those n
        (None: the last token occurs in no source). Longer matches predict better, shorter ones
        more often; the average lets both count."""
        if not context:
            return None
        last = context[-1]
        longest = min(self.max_ngram, len(context))
        by_n: list[dict[int, int]] = [{} for _ in range(longest)]
        for src, where, pairs in zip(self.sources, self.positions, self.pair_positions):
            for i in where.get(last, ())[-MAX_OCCURRENCES:]:
                by_n[0][src[i + 1]] = by_n[0].get(src[i + 1], 0) + 1
            if longest < 2:
                continue
            for i in pairs.get((context[-2], last), ())[-MAX_OCCURRENCES:]:
                m = 2  # the match length ending at src[i]
                while m < longest and i - m >= 0 and src[i - m] == context[-1 - m]:
                    m += 1
                nxt = src[i + 1]
                for n in range(1, m):
                    by_n[n][nxt] = by_n[n].get(nxt, 0) + 1
        levels = [c for c in by_n if c]
        if not levels:
            return None
        q: dict[int, float] = {}
        for counts in levels:
            total = sum(counts.values())
            for t, c in counts.items():
                q[t] = q.get(t, 0.0) + c / total / len(levels)
        return q


def sample_sibling_draft(context: Sequence[int], k: int, index: SiblingIndex,
                         generator: torch.Generator) -> tuple[list[int], list[dict[int, float]]]:
    """A draft of at most ``k`` tokens, each drawn (with the request's ``generator``) from the
    siblings' ``q`` given the context and the draft so far, with the ``q`` it was drawn from: the
    verify rule needs it. Ends where no source matches."""
    tokens: list[int] = []
    qs: list[dict[int, float]] = []
    ctx = list(context)
    for _ in range(k):
        q = index.next_distribution(ctx)
        if q is None:
            break
        u = float(torch.rand((), generator=generator))
        items = sorted(q.items())
        tok = items[-1][0]
        acc = 0.0
        for t, w in items:
            acc += w
            if u < acc:
                tok = t
                break
        tokens.append(tok)
        qs.append(q)
        ctx.append(tok)
    return tokens, qs
