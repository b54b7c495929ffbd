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

Scored siblings (:class:`SourceDists`, ``rollout.spec_sibling_top_k`` above zero): the counts above
estimate what follows a context from the few tokens the siblings happened to draw there. The
distributions those tokens were drawn from are a far better ``q``: the instance holds the siblings'
own weights (C1), so one forward over a sibling gives the target's distribution after each of its
tokens, and where the request's last tokens match a sibling's, the sibling's distribution there is
close to the request's own. ``q`` is then the mean of those distributions (top ``K`` of each,
renormalised) at each sibling's occurrence of the longest match nearest the request's position,
drawn from as the mixture it is (:class:`RowMixture`: a row, then a token from it), so a draft
token costs lookups in a few rows rather than a merge of them all.
Measured on the main job's model (the same positions as above): kept 0.77 of the time, against
0.37 for the counts and 0.42 for the best any fixed token could do (when it was measured; the
current figures are in docs/results/speculation.md).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

MAX_NGRAM = 4
MIN_NGRAM = 1
#: occurrences looked at per source and match level (the most recent): bounds a draft's cost on
#: long sources with frequent tokens; drafts only set speed, never what is sampled. The matches
#: of two tokens or more are found through the last two tokens, so a frequent last token (a space,
#: a newline) does not crowd out the occurrences that match the context further back.
MAX_OCCURRENCES = 64
#: with scored sources, the occurrences looked at per source: the nearest the request's position
#: (before or after it), where the longest matches of an answer to the same prompt are
SCORED_OCCURRENCES = 16
#: rows of scored sources a :class:`SiblingIndex` keeps ready to draw from (a draft's tokens and
#: the next step's look at the same rows again); past it the cache starts over
ROW_CACHE = 1024


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


def sibling_context(prompt: Sequence[int], source: Sequence[int], max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """The whole sequence a :func:`sibling_source` was cut from, and where the source starts in it:
    the request's prompt before the source's ``max_ngram - 1`` prompt tokens when the source starts
    with them (a sibling of the same prompt), else the source alone. What the scored distributions
    are computed over; a source taken for the wrong case only gets a worse ``q``, never a
    different sample."""
    keep = max_ngram - 1
    head = len(prompt) - keep
    if head > 0 and list(source[:keep]) == list(prompt[head:]):
        return list(prompt[:head]) + list(source), head
    return list(source), 0


@dataclass(frozen=True)
class SourceDists:
    """What the target drew each next token of a sibling source from: row ``i`` is the
    distribution after ``source[i]``, its ``K`` likeliest tokens (``ids``) and their
    probabilities renormalised (``probs``), both ``[len(source), K]``; ``start`` is the position
    of ``source[0]`` in the sibling's whole sequence (:func:`sibling_context`), which places the
    source's tokens against the request's own."""

    ids: torch.Tensor
    probs: torch.Tensor
    start: int = 0

    def __post_init__(self) -> None:
        if self.ids.shape != self.probs.shape or self.ids.dim() != 2:
            raise ValueError(f"SourceDists needs ids and probs of one [positions, K] shape, got "
                             f"{tuple(self.ids.shape)} and {tuple(self.probs.shape)}")


@dataclass(frozen=True)
class DraftDistribution:
    """A drafter's ``q`` normalised, ready to draw draft tokens from: ``q`` itself (token ->
    probability), its tokens in ``q``'s own order and their running sums. Never changed once
    built, so one can serve many drafts. The verify rule gets it as it is
    (:class:`~dora_megatron.rollout.engine.sampler.DraftLaw`): the rule is exact for the ``q`` a
    token was drawn from, whatever rounding its weights carry."""

    q: dict[int, float]
    tokens: tuple[int, ...]
    cumulative: tuple[float, ...]

    @staticmethod
    def of(weights: Mapping[int, float]) -> DraftDistribution:
        """From unnormalised ``weights`` (sums of rounded shares), tokens of weight zero left out:
        a token ``q`` gives no mass must never be drawn."""
        total = sum(w for w in weights.values() if w > 0.0)
        q = {t: w / total for t, w in weights.items() if w > 0.0}  # weights' own order: the same every time
        cum, acc = [], 0.0
        for w in q.values():
            acc += w
            cum.append(acc)
        return DraftDistribution(q, tuple(q), tuple(cum))

    def pick(self, u: float) -> int:
        """The token a uniform ``u`` in [0, 1) picks: the first whose running sum exceeds ``u``
        (the last where rounding leaves the sum at or below ``u``)."""
        return self.tokens[min(bisect.bisect_right(self.cumulative, u), len(self.tokens) - 1)]

    def draw(self, generator: torch.Generator) -> int:
        """A token drawn from ``q`` with the request's generator (a double-precision uniform:
        float32's 2**-24 grain would never draw a token below it)."""
        return self.pick(float(torch.rand((), generator=generator, dtype=torch.float64)))

    def prob(self, token: int) -> float:
        """``q(token)``, what the verify rule divides by."""
        return self.q.get(token, 0.0)

    def support(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``'s tokens and probabilities, for the redraw after a rejection."""
        return torch.tensor(list(self.q), dtype=torch.long), torch.tensor(list(self.q.values()), dtype=torch.float64)


@dataclass(frozen=True)
class ScoredRow:
    """One row of a scored source as plain lists (``ids``, ``probs``; the draws and lookups read
    them) and as the source's own tensors (``ids_t``, ``probs_t``; the redraw after a rejection
    reads those), with the running sums of ``probs`` (the row's mass is ``cumulative[-1]``, 1 up
    to the rounding of the top-K renormalisation). A token is drawn with ``u * mass``, so a token
    of probability zero (cut by top-k or top-p) is never drawn. A token's whole weight is at its
    first occurrence: a top-K row's tokens are distinct, and a point-mass row
    (:func:`~dora_megatron.rollout.engine.sampled_dists.record_dists`) repeats only its zero-weight
    padding after the token that carries the mass."""

    ids: list[int]
    probs: list[float]
    cumulative: list[float]
    ids_t: torch.Tensor
    probs_t: torch.Tensor

    @staticmethod
    def of(ids: torch.Tensor, probs: torch.Tensor) -> ScoredRow:
        p = probs.tolist()
        return ScoredRow(ids.tolist(), p, list(itertools.accumulate(p)), ids, probs)

    def pick(self, u: float) -> int:
        """The token a uniform ``u`` in [0, 1) picks, in proportion to ``probs``."""
        cum = self.cumulative
        return self.ids[min(bisect.bisect_right(cum, u * cum[-1]), len(cum) - 1)]

    def prob(self, token: int) -> float:
        """The row's normalised probability of ``token`` (0 outside the row)."""
        return self.probs[self.ids.index(token)] / self.cumulative[-1] if token in self.ids else 0.0


@dataclass(frozen=True)
class RowMixture:
    """The scored siblings' ``q``: the equal-weight mixture of one row per source. Drawn as a
    mixture is (a row uniformly, then a token from it) and its probability of a token summed
    over the rows, so a draft token costs a few lookups whatever the rows' width, instead of
    merging every row into one distribution (the whole ``q`` is only read by the verify rule
    after a rejection, :meth:`support`)."""

    rows: tuple[ScoredRow, ...]

    def draw(self, generator: torch.Generator) -> int:
        """A row uniformly, then a token from it (double-precision uniforms)."""
        u_row, u_tok = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        return self.rows[min(int(u_row * len(self.rows)), len(self.rows) - 1)].pick(u_tok)

    def prob(self, token: int) -> float:
        """``q(token)``: the mean of the rows' probabilities of it."""
        return sum(r.prob(token) for r in self.rows) / len(self.rows)

    def support(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's tokens and their shares of ``q`` (a token in several rows repeats; rows
        may differ in width)."""
        n = len(self.rows)
        scale = torch.tensor([r.cumulative[-1] * n for r in self.rows], dtype=torch.float64)
        widths = torch.tensor([len(r.ids) for r in self.rows])
        weights = torch.cat([r.probs_t for r in self.rows]).to(torch.float64) / scale.repeat_interleave(widths)
        return torch.cat([r.ids_t for r in self.rows]), weights


class SiblingIndex:
    """The positions of every token in a request's sibling sources, for drawing sampled drafts.

    Built once per set of sources (a request's ``draft_sources`` change only when siblings finish),
    it holds one list of positions per distinct token and source: memory linear in the sources'
    length, unlike an n-gram table. With ``dists`` (one :class:`SourceDists` per source) ``q`` is
    the scored siblings' mean distribution at the longest match, else the counts'."""

    def __init__(self, sources: Sequence[Sequence[int]], max_ngram: int = MAX_NGRAM,
                 dists: Sequence[SourceDists] | None = None) -> None:
        self.sources = [list(src) for src in sources]
        self.max_ngram = max_ngram
        if dists is not None:
            bad = [i for i, (src, d) in enumerate(zip(self.sources, dists)) if d.ids.shape[0] != len(src)]
            if len(dists) != len(self.sources) or bad:
                raise ValueError(f"SiblingIndex needs one SourceDists row per source token: {len(dists)} "
                                 f"dists for {len(self.sources)} sources, mismatched sources {bad[:5]}")
        self.dists = None if dists is None else list(dists)
        self._rows: dict[tuple[int, int], ScoredRow] = {}
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
        if self.dists is not None:
            return self._scored_distribution(context)
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

    def draft_distribution(self, context: Sequence[int]) -> DraftDistribution | RowMixture | None:
        """What a draft token after ``context`` is drawn from (None: no source matches): with
        scored sources the mixture of the rows :meth:`next_distribution` averages, else that
        ``q`` normalised."""
        if not context:
            return None
        if self.dists is None:
            q = self.next_distribution(context)
            return None if q is None else DraftDistribution.of(q)
        return self._mixture(context)

    def _mixture(self, context: Sequence[int]) -> RowMixture | None:
        """The rows :meth:`_scored_picks` picks, as a mixture (a row without mass, from NaN
        logits, left out)."""
        rows = tuple(r for r in (self._row(s, i) for s, i in self._scored_picks(context))
                     if r.cumulative and r.cumulative[-1] > 0.0)
        return RowMixture(rows) if rows else None

    def _scored_distribution(self, context: Sequence[int]) -> dict[int, float] | None:
        """``q`` from scored sources: the mean, over the sources, of the distribution after each
        source's occurrence of the longest match of the context's last tokens (up to
        ``max_ngram``) nearest to the context's own position (:meth:`_scored_picks`), zero
        shares dropped."""
        mixture = self._mixture(context)
        if mixture is None:
            return None
        q: dict[int, float] = {}
        ids, weights = mixture.support()
        for t, w in zip(ids.tolist(), weights.tolist()):
            q[t] = q.get(t, 0.0) + w
        return {t: w for t, w in q.items() if w > 0.0} or None

    def _scored_picks(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """The (source, position) rows :meth:`_scored_distribution` averages: per source, its
        occurrence of the longest match nearest the context's own position (the lower position on
        a tie), for the sources that reach the longest match of any. One row per source, not every
        occurrence: a sibling at the same point of the answer says most about what follows here
        (measured: kept 0.77 of the time, against 0.75 for the mean over every occurrence of the
        longest match). Occurrences are visited nearest first, among the ``SCORED_OCCURRENCES``
        nearest that position, and a source stops at its first match of full length: a long
        source costs no more than a short one, and a well-aligned one a single comparison."""
        assert self.dists is not None
        last = context[-1]
        longest = min(self.max_ngram, len(context))
        here = len(context) - 1  # the position of the context's last token
        best = 0
        picked: list[tuple[int, int]] = []  # by source, ascending
        for s, (src, where, pairs, d) in enumerate(zip(self.sources, self.positions, self.pair_positions, self.dists)):
            found, m0 = (pairs.get((context[-2], last)), 2) if longest >= 2 else (None, 1)
            if not found:
                found, m0 = where.get(last), 1
            if not found or (m0 == 1 and best > 1):  # only single-token matches where longer ones exist
                continue
            target = here - d.start
            hi = bisect.bisect_left(found, target)  # found[hi:] at or after target, found[:hi] before
            lo = hi - 1
            own, at = 0, -1
            for _ in range(SCORED_OCCURRENCES):
                if hi < len(found) and (lo < 0 or found[hi] - target < target - found[lo]):
                    i = found[hi]
                    hi += 1
                elif lo >= 0:
                    i = found[lo]
                    lo -= 1
                else:
                    break
                m = m0
                while m < longest and i - m >= 0 and src[i - m] == context[-1 - m]:
                    m += 1
                if m > own:  # nearer occurrences came first: an equal match further away loses
                    own, at = m, i
                if m == longest:
                    break
            if own > best:
                best, picked = own, [(s, at)]
            elif own == best:
                picked.append((s, at))
        return picked

    def _row(self, s: int, i: int) -> ScoredRow:
        """Row ``i`` of source ``s``'s distributions, ready to draw from (kept: a draft's tokens
        and the next steps' look at the same rows again)."""
        row = self._rows.get((s, i))
        if row is None:
            if len(self._rows) >= ROW_CACHE:
                self._rows.clear()
            d = self.dists[s]  # type: ignore[index]
            row = self._rows[(s, i)] = ScoredRow.of(d.ids[i], d.probs[i])
        return row


def sample_sibling_draft(context: Sequence[int], k: int, index: SiblingIndex, generator: torch.Generator
                         ) -> tuple[list[int], list[DraftDistribution | RowMixture]]:
    """A draft of at most ``k`` tokens, each drawn (with the request's ``generator``) from the
    siblings' ``q`` given the context and the draft so far, with the ``q`` it was drawn from: the
    verify rule needs it. Ends where no source matches."""
    tokens: list[int] = []
    qs: list[DraftDistribution | RowMixture] = []
    ctx = list(context)
    for _ in range(k):
        q = index.draft_distribution(ctx)
        if q is None:
            break
        tok = q.draw(generator)
        tokens.append(tok)
        qs.append(q)
        ctx.append(tok)
    return tokens, qs
