"""The distributions an instance drew its finished requests' tokens from, kept for their siblings.

WHY: a sibling's scores (:mod:`~dora_megatron.rollout.engine.sibling_scores`) cost a prefill of
its answer, paid again by every request that drafts from it; but when the sibling ran on this
instance, the instance computed exactly those distributions while sampling it. Keeping each
finished request's (the ``K`` likeliest tokens of each output position's sampling distribution)
makes its siblings' drafts free of that forward. Only a request whose every output token was
drawn here, with the weights the instance still holds, is kept: a migrated-in request or one that
lived through a weight change is not (its record would mix instances or versions), and a weight
load forgets them all (C1: a request's siblings share its version).

Bounded by rows (output tokens): as many as the instance's KV pool holds tokens, the oldest
record forgotten first; at ``K`` = 32 a row is 384 bytes of host memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from dora_megatron.rollout.engine.drafter import SourceDists, sibling_context


@dataclass(frozen=True)
class SampledRecord:
    """One finished request: its prompt's length and, per output token, the distribution it was
    drawn from (``ids``, ``probs``: ``[output tokens, K]``)."""

    prompt_len: int
    ids: torch.Tensor
    probs: torch.Tensor


class SampledDists:
    """Finished requests' records by their whole token sequence, least recently used first out."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.rows = 0
        self._by_seq: OrderedDict[tuple[int, ...], SampledRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_seq)

    def keep(self, tokens: Sequence[int], record: SampledRecord) -> None:
        """Keep the record of the request whose prompt + output is ``tokens``."""
        n = record.ids.shape[0]
        if n != len(tokens) - record.prompt_len or n > self.max_rows:
            return
        key = tuple(tokens)
        old = self._by_seq.pop(key, None)
        if old is not None:
            self.rows -= old.ids.shape[0]
        self._by_seq[key] = record
        self.rows += n
        while self.rows > self.max_rows:
            _, gone = self._by_seq.popitem(last=False)
            self.rows -= gone.ids.shape[0]

    def clear(self) -> None:
        self._by_seq.clear()
        self.rows = 0

    def source_dists(self, prompt: Sequence[int], source: Sequence[int]) -> SourceDists | None:
        """The :class:`SourceDists` of a request's sibling ``source`` (as :func:`sibling_source`
        cut it) from the sibling's record, None without one. Rows before the sibling's first
        output token (prompt tokens) and after its last are a point mass on the token that
        follows there: what the source's own text says."""
        seq, start = sibling_context(prompt, source)
        rec = self._by_seq.get(tuple(seq))
        if rec is None:
            return None
        self._by_seq.move_to_end(tuple(seq))
        n, k = len(source), rec.ids.shape[1]
        at = torch.arange(n) + start + 1 - rec.prompt_len  # the output token drawn after source[j]
        inside = (at >= 0) & (at < rec.ids.shape[0])
        following = torch.tensor(list(seq[start + 1 :]) + [seq[-1]])  # the token after source[j] (last: none)
        ids = torch.zeros((n, k), dtype=rec.ids.dtype)
        probs = torch.zeros((n, k), dtype=rec.probs.dtype)
        ids[:, 0] = following
        probs[:, 0] = 1.0
        ids[inside] = rec.ids[at[inside]]
        probs[inside] = rec.probs[at[inside]]
        return SourceDists(ids, probs, start)
