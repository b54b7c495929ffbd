"""Per-request token sampling with a per-request RNG, and the logprob of the chosen token.

Why per request: a request's random stream must not depend on which other requests share its
batch, and it must travel with the request when it migrates, so each request owns a
``torch.Generator`` (seeded from ``sampling_seed`` when given) whose state is exported.

Semantics (as SGLang's sampler): temperature below ``SAMPLING_EPS`` (or top_k 1) is greedy (argmax) and the logprob
is ``log_softmax(logits)``; otherwise logits are divided by the temperature, the reported
logprob is ``log_softmax(logits / T)`` of the chosen token (before top-k/top-p truncation), and
the token is drawn from the top-k/top-p truncated, renormalised distribution.

Speculative verification (:func:`verify_draft`) keeps these semantics exactly: a draft token is
kept or replaced by the standard rejection rule against the same truncated distribution, so the
tokens have the distribution plain sampling gives, and the reported logprobs are the same
``log_softmax(logits / T)`` of the kept tokens.
"""

from __future__ import annotations

import secrets

import torch

from typing import Protocol, Sequence

from dora_megatron.comm.protocol import SamplingParams


class DraftLaw(Protocol):
    """What a sampled draft token was drawn from, as the verify rule reads it: the probability
    of one token, and the whole law as a tensor of tokens and one of their weights (a token may
    repeat: its weights add) for the redraw after a rejection, the only time the rule needs all
    of it."""

    def prob(self, token: int) -> float: ...

    def support(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def make_generator(seed: int | None) -> torch.Generator:
    """CPU generator seeded from ``seed`` (a fresh random seed when None)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return g


#: weights per block of :func:`locate_index`: a long vector is searched block by block, so no
#: double-precision copy of a whole vocabulary is made per draw
DRAW_BLOCK = 1024


def draw_index(weights: torch.Tensor, generator: torch.Generator) -> int:
    """An index of 1-D non-negative ``weights`` drawn with probability proportional to its weight
    (:func:`locate_index` at a uniform ``u`` in [0, 1), drawn in double precision).

    WHY not ``torch.multinomial``: on CPU it takes about 3 ms for one draw over a 151,936-token
    vocabulary (Qwen3's), against a fraction of a millisecond here (``tools/bench_engine.py``)."""
    return locate_index(weights, float(torch.rand((), generator=generator, dtype=torch.float64)))


def locate_index(weights: torch.Tensor, u: float) -> int:
    """The index whose interval of the running sum of ``weights`` holds ``u`` times their total:
    the first whose running sum exceeds it. Sums are in double precision: a float32 running sum
    snaps each interval to float32 steps (about 6e-8 near 1), so an index below that would never
    be drawn and the others drift by as much (a float32 sum of a block would do the same to a
    small weight beside a large one). A long vector is summed per block of :data:`DRAW_BLOCK`
    in double, the block holding the point found, and the running sum taken within that block
    only. An index of weight zero has an interval of width zero and is never returned."""
    n = weights.shape[0]
    if n <= DRAW_BLOCK:
        cum = running_sum(weights)
        return pick_index(cum, u * _total(cum), weights)
    full = n - n % DRAW_BLOCK
    sums = weights[:full].reshape(-1, DRAW_BLOCK).sum(1, dtype=torch.float64)
    if full < n:
        sums = torch.cat([sums, weights[full:].sum(dtype=torch.float64).reshape(1)])
    by_block = sums.cumsum(0)
    x = u * _total(by_block)
    b = pick_index(by_block, x, sums)
    before = float(by_block[b - 1]) if b else 0.0
    block = weights[b * DRAW_BLOCK : (b + 1) * DRAW_BLOCK]
    return b * DRAW_BLOCK + pick_index(running_sum(block), x - before, block)


def _total(cum: torch.Tensor) -> float:
    total = float(cum[-1])
    if not total > 0.0:
        raise ValueError(f"drawing a token needs weights with positive mass, got a total of {total}")
    return total


def running_sum(weights: torch.Tensor) -> torch.Tensor:
    """The running sum of 1-D ``weights`` in double precision (:func:`draw_index`)."""
    return weights.to(torch.float64).cumsum(0)


def pick_index(cum: torch.Tensor, x: float, weights: torch.Tensor) -> int:
    """The first index whose running sum ``cum`` (float64) exceeds ``x`` in [0, total); where
    rounding puts ``x`` at the total, the last index with weight."""
    idx = int(torch.searchsorted(cum, torch.tensor([x], dtype=torch.float64), right=True))
    if idx >= len(cum):
        idx = int(torch.nonzero(weights)[-1])
    return idx


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the tokens outside top-k and the top-p nucleus of each distribution (the last
    dimension); renormalise."""
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def _target(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, probs)`` of non-greedy ``logits`` (a row, or rows in the last dimension): the
    reported logprobs and the distribution a token is drawn from (top-k/top-p truncated)."""
    logp = torch.log_softmax(logits.to(torch.float32) / params.temperature, dim=-1)
    return logp, truncate_probs(logp.exp(), params.top_k, params.top_p)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Choose the next token from 1-D ``logits``; return ``(token_id, logprob)``."""
    logits = logits.to(torch.float32)
    if params.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp, probs = _target(logits, params)
    tok = draw_index(probs.cpu(), generator)
    return tok, float(logp[tok])


def accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """One draft token of a deterministic drafter against the target distribution ``probs``.

    The drafter's distribution is a point mass on ``draft``, so the rejection rule of speculative
    sampling (Leviathan et al. 2023; Chen et al. 2023) reads: keep ``draft`` with probability
    ``p(draft)``, else draw from ``p`` with ``draft`` removed and renormalised. The result is
    distributed as ``p`` exactly: ``P(draft) = p(draft)`` and, for ``x != draft``,
    ``(1 - p(draft)) * p(x) / (1 - p(draft)) = p(x)``. A different token than ``draft`` ends the
    verified run (the caller stops there).
    """
    probs = probs.cpu()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return keep_or_redraw(probs, draft, None, u, float(probs[draft]), generator)


def redraw_without(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """The token after a rejected point-mass draft: drawn from ``probs`` with ``draft`` removed and
    renormalised (:func:`accept_or_resample`); ``draft`` itself where no other token has mass
    (``p(draft)`` rounds to 1 yet the test rejected it)."""
    residual = probs.clone()
    residual[draft] = 0.0
    if float(residual.sum()) <= 0.0:
        return draft
    return draw_index(residual, generator)


def accept_or_resample_sampled(probs: torch.Tensor, draft: int, q: DraftLaw, generator: torch.Generator) -> int:
    """One draft token drawn from the drafter's distribution ``q`` (:class:`DraftLaw`), against the
    target distribution ``probs``: the general rejection rule of speculative sampling.

    Keep ``draft`` with probability ``min(1, p(draft) / q(draft))``, else draw from
    ``max(p - q, 0)`` renormalised. The result is distributed as ``p``: a token ``x`` comes out
    with probability ``min(p(x), q(x))`` by being drafted and kept plus
    ``(1 - sum(min(p, q))) * max(p(x) - q(x), 0) / sum(max(p - q, 0))`` by the redraw, and the two
    sums are equal, so ``min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x)``. It is kept with probability
    ``sum(min(p, q))``: with ``q`` a point mass this is :func:`accept_or_resample`.
    """
    probs = probs.cpu()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    return keep_or_redraw(probs, draft, q, u, float(probs[draft]), generator)


def keep_or_redraw(probs: torch.Tensor, draft: int, q: DraftLaw | None, u: float, p_draft: float,
                   generator: torch.Generator) -> int:
    """The rejection rule for one draft token, its inputs already read: keep ``draft`` when
    ``u * q(draft) < p(draft)`` (``q`` None: a point mass, ``q(draft) = 1``), else redraw
    (:func:`redraw_without`, :func:`redraw_residual`). ``u``: a uniform of this test only. WHY
    apart: :func:`verify_draft` reads a whole step's ``p(draft)`` and uniforms at once, the
    single-token rules one at a time; both decide here."""
    if u * (1.0 if q is None else q.prob(draft)) < p_draft:
        return draft
    return redraw_without(probs, draft, generator) if q is None else redraw_residual(probs, draft, q, generator)


def redraw_residual(probs: torch.Tensor, draft: int, q: DraftLaw, generator: torch.Generator) -> int:
    """The token after a rejected draft drawn from ``q``: drawn from ``max(p - q, 0)`` renormalised
    (:func:`accept_or_resample_sampled`); ``draft`` itself where that has no mass (``p`` and ``q``
    agree wherever ``p`` has mass, up to rounding)."""
    ids, weights = q.support()
    residual = probs.clone()
    residual.index_put_((ids,), -weights.to(residual.dtype), accumulate=True)
    residual.clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        return draft
    return draw_index(residual, generator)


def verify_draft(
    logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, generator: torch.Generator,
    q: Sequence[DraftLaw] | None = None,
) -> tuple[list[int], list[float]]:
    """The tokens one verify pass yields, with their logprobs.

    ``logits`` has ``len(draft) + 1`` rows: row ``i`` predicts the token after the context plus
    ``draft[:i]``. Draft tokens are kept while the rule of :func:`accept_or_resample` (greedy:
    argmax equality) keeps them; the first replaced token ends the run; after a fully kept draft
    the last row gives one more token. So at least one and at most ``len(draft) + 1`` tokens.
    Stop tokens and length limits are the caller's: it cuts the run where the request ends.
    ``q``: the distribution each draft token was drawn from (a sampled draft,
    :func:`accept_or_resample_sampled`); None: the draft was chosen deterministically.
    """
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"verify_draft needs {len(draft) + 1} logits rows for a draft of {len(draft)}, "
                         f"got {logits.shape[0]}")
    if q is not None and len(q) != len(draft):
        raise ValueError(f"verify_draft needs a distribution per draft token: {len(q)} for {len(draft)}")
    logits = logits.to(torch.float32)
    if params.greedy:
        tokens: list[int] = []
        logprobs: list[float] = []
        for i, d in enumerate(draft):
            tok = int(torch.argmax(logits[i]))
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits[i], dim=-1)[tok]))
            if tok != d:
                return tokens, logprobs
        tok, lp = sample_token(logits[len(draft)], params, generator)
        return [*tokens, tok], [*logprobs, lp]
    logp, probs = _target(logits, params)  # every row at once
    probs = probs.cpu()
    # the rule of accept_or_resample(_sampled) per draft token, its inputs read in two operations:
    # each draft token's p(d), and one uniform per test (used by that test only, so independent of
    # every other draw; those of the tests after a rejection go unused)
    draft = [int(d) for d in draft]
    p_draft = probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)].tolist()
    uniforms = torch.rand(len(draft), generator=generator, dtype=torch.float64).tolist()
    tokens = []
    for i, d in enumerate(draft):
        tok = keep_or_redraw(probs[i], d, None if q is None else q[i], uniforms[i], p_draft[i], generator)
        tokens.append(tok)
        if tok != d:  # a redraw returns the draft itself only where nothing else has mass
            break
    else:
        tokens.append(draw_index(probs[len(draft)], generator))
    rows = torch.arange(len(tokens))
    return tokens, logp[rows, torch.tensor(tokens)].tolist()
