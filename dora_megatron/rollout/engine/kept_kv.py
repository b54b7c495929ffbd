"""The KV of finished turns kept on the instance for the trajectory's next turn.

WHY: a workflow's trajectory leaves the engine when a turn returns (its tool runs), and its next
turn sends the whole context again. Without the last turn's KV the instance recomputes the whole
prefix (prompt, earlier turns, tool results) at every turn. A request submitted with
``dora_keep_kv`` leaves its KV here when it finishes; the next request of the same rid whose input
starts with the kept tokens continues from it (only the tool's tokens are computed), and
``/dora/export_kv`` / ``/dora/import_kv`` carry it to another instance of the version when the
next turn is placed there.

Bounded, since nothing guarantees a next turn comes: an entry lives ``keep_s`` seconds at most,
all entries together hold at most ``max_blocks`` blocks of the instance's pool (the oldest goes
first), and a request that cannot be admitted for want of blocks takes them from the kept entries
(kept KV never delays new work). A weight change drops them all (their KV belongs to the old
weights; C1). The blocks an entry holds are reserved in the instance's :class:`BlockPool`, so
``/v1/loads`` reports them as used.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from dora_megatron.rollout.engine.kv_cache import BlockPool, RequestKV, blocks_for


@dataclass
class KeptEntry:
    """One finished turn's KV: ``tokens`` are those it covers (every token of the request but its
    last sampled one), computed with weights ``version``."""

    tokens: list[int]
    kv: RequestKV
    version: str
    blocks: int
    expires: float


class KeptKV:
    """The kept entries of one instance, by rid (oldest first); ``pool``: the instance's blocks."""

    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int, keep_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max(0, int(max_blocks))
        self.keep_s = float(keep_s)
        self.clock = clock
        self.entries: OrderedDict[str, KeptEntry] = OrderedDict()
        self.blocks = 0  # held by the entries (part of pool.used)
        self.reused_tokens = 0  # prefix tokens later requests did not compute again
        self.evicted = 0  # entries dropped before use (time, budget, admission, weight change)

    def keep(self, rid: str, tokens: list[int], kv: RequestKV, version: str) -> bool:
        """Keep ``kv`` (already out of the pool's accounting) for ``rid``; False when it cannot fit
        the budget or the pool's free blocks (then nothing is kept)."""
        self.release(rid)
        self.expire()
        need = blocks_for(kv.length, self.block_size)
        if kv.length == 0 or need > self.max_blocks:
            return False
        while self.entries and (self.blocks + need > self.max_blocks or not self.pool.can_reserve(need)):
            self._drop(next(iter(self.entries)), evicted=True)
        if not self.pool.can_reserve(need):
            return False
        self.pool.reserve(need)
        self.blocks += need
        self.entries[rid] = KeptEntry(list(tokens[:kv.length]), kv, version, need, self.clock() + self.keep_s)
        return True

    def take(self, rid: str, tokens: list[int], version: str) -> RequestKV | None:
        """The kept KV of ``rid`` if ``tokens`` (a new request's input) continue it under weights
        ``version`` (its blocks go back to the pool: the request reserves its own); any entry of
        ``rid`` is gone afterwards."""
        self.expire()
        e = self.entries.get(rid)
        if e is None:
            return None
        usable = e.version == version and len(tokens) > len(e.tokens) and tokens[:len(e.tokens)] == e.tokens
        self._drop(rid, evicted=not usable)
        if not usable:
            return None
        self.reused_tokens += len(e.tokens)
        return e.kv

    def pop(self, rid: str) -> KeptEntry | None:
        """Remove and return ``rid``'s entry (an export); its blocks go back to the pool."""
        self.expire()
        e = self.entries.get(rid)
        if e is not None:
            self._drop(rid, evicted=False)
        return e

    def release(self, rid: str) -> bool:
        """Forget ``rid``'s entry (its trajectory ended or moved); whether there was one."""
        if rid not in self.entries:
            return False
        self._drop(rid, evicted=False)
        return True

    def free_for(self, need: int) -> None:
        """Drop the oldest entries until the pool can reserve ``need`` blocks (or none is left)."""
        while self.entries and not self.pool.can_reserve(need):
            self._drop(next(iter(self.entries)), evicted=True)

    def clear(self) -> None:
        """Drop every entry (the weights changed: the kept KV belongs to the old ones)."""
        for rid in list(self.entries):
            self._drop(rid, evicted=True)

    def expire(self) -> None:
        now = self.clock()
        for rid in [r for r, e in self.entries.items() if e.expires <= now]:
            self._drop(rid, evicted=True)

    def _drop(self, rid: str, evicted: bool) -> None:
        e = self.entries.pop(rid)
        self.pool.release(e.blocks)
        self.blocks -= e.blocks
        self.evicted += int(evicted)

    def info(self) -> dict[str, int]:
        return {"kv_kept_requests": len(self.entries), "kv_kept_blocks": self.blocks,
                "kv_kept_reused_tokens": self.reused_tokens, "kv_kept_evicted": self.evicted}
