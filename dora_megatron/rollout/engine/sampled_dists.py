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
record forgotten first; at ``K`` = 32 a row is 384 bytes of host memory, and a record's key is a
16-byte digest of its sequence. The scoring forward's results are kept the same way (the rows
after the prompt of a sibling of the same prompt), so the other requests of a group that run here
do not score that sibling again.
"""

from __future__ import annotations

import hashlib
from array import array
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


class RecordRows:
    """A running request's record: the rows of each step appended (copies, since a slice would keep
    the step's whole tensor alive), merged every :attr:`BLOCK_STEPS` steps so a long request holds
    a few tensors per block, not two per step."""

    BLOCK_STEPS = 64

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # merged
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # this block's steps
        self.n = 0

    def append(self, ids: torch.Tensor, probs: torch.Tensor) -> None:
        self.pending.append((ids.clone(), probs.clone()))
        self.n += ids.shape[0]
        if len(self.pending) >= self.BLOCK_STEPS:
            self.blocks.append(self._merge(self.pending))
            self.pending = []

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row so far: ``(ids, probs)``, ``[n, K]``."""
        return self._merge(self.blocks + self.pending)

    @staticmethod
    def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([i for i, _ in parts]), torch.cat([p for _, p in parts])


class SampledDists:
    """Finished requests' records by their whole token sequence, least recently used first out."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.rows = 0
        #: by a digest of the token sequence (a sequence as key would hold every prompt again); a
        #: collision could only hand a request another sibling's distributions: drafts, not tokens
        self._by_seq: OrderedDict[bytes, SampledRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_seq)

    def keep(self, tokens: Sequence[int], record: SampledRecord) -> None:
        """Keep the record of the request whose prompt + output is ``tokens``."""
        n = record.ids.shape[0]
        if n == 0 or n != len(tokens) - record.prompt_len or n > self.max_rows:
            return
        key = _digest(tokens)
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
        key = _digest(seq)
        rec = self._by_seq.get(key)
        if rec is None:
            return None
        self._by_seq.move_to_end(key)
        return record_dists(rec, seq, start)


def record_dists(rec: SampledRecord, seq: Sequence[int], start: int) -> SourceDists:
    """The :class:`SourceDists` of the source ``seq[start:]`` from the record of ``seq``: rows
    before its first output token (prompt tokens) and after its last are a point mass on the token
    that follows there, what the source's own text says. A scored source goes through here too, so
    a request drafts from the same rows whether its instance recorded or scored its siblings (a
    migrated request continues as it would have)."""
    n, k = len(seq) - start, rec.ids.shape[1]
    at = torch.arange(n) + start + 1 - rec.prompt_len  # the output token drawn after seq[start + j]
    inside = (at >= 0) & (at < rec.ids.shape[0])
    following = torch.tensor(list(seq[start + 1 :]) + [seq[-1]])  # the token after seq[start + j] (last: none)
    ids = torch.zeros((n, k), dtype=rec.ids.dtype)
    probs = torch.zeros((n, k), dtype=rec.probs.dtype)
    ids[:, 0] = following
    probs[:, 0] = 1.0
    ids[inside] = rec.ids[at[inside]]
    probs[inside] = rec.probs[at[inside]]
    return SourceDists(ids, probs, start)


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()
