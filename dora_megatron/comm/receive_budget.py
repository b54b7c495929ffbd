"""How many bytes of big answers one process reads and decodes at once.

WHY: a ``/generate`` answer arrives only when its request has finished, and with routed experts a
long one is tens of MB (a 30K-token answer of a 48-layer top-8 MoE: ~60 MB of base64). When the
engines finish answers faster than the process can decode them, aiohttp reads every waiting socket
at once, so every waiting answer is held half-read: at 64 instances x 64 slots the controller grew
past 5 GB (``docs/results/controller_scale.md``). Each big answer here first takes its size from a
fixed budget, in arrival order, and gives it back once decoded; the others wait with their bytes in
the engine's socket (aiohttp stops reading a connection whose buffer is full), as a server's
answers wait for a slow client. Memory then stays near the budget whatever the answers' sizes, and
the wait is back-pressure on the engines, not lost work.
"""

from __future__ import annotations

import asyncio
from collections import deque

#: bytes of big ``/generate`` answers one process reads and decodes at once. WHY 512 MiB: several
#: times the largest answer (a 30K-token answer with a 48-layer top-8 MoE's routed experts: ~60 MB
#: of base64), so one slow answer never serialises the rest, and small against the 5 GB that
#: half-read answers held without it at 64 instances x 64 slots.
RECEIVE_BUDGET_BYTES = 512 << 20


class ReceiveBudget:
    """``max_bytes`` of answers held at once, granted first come, first served (a big answer is
    not starved by a stream of small ones). An answer larger than the whole budget takes all of
    it. Used on one event loop only; a process's :class:`~dora_megatron.comm.answer_reader.AnswerReader`
    holds one."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a receive budget must be positive, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.used = 0  # bytes granted and not yet given back
        self.waited = 0  # grants that had to wait: how often the budget held an answer back
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, size: int) -> int:
        """Wait until ``size`` bytes (at most the whole budget) are free; returns the bytes granted,
        to be handed back to :meth:`release`. A cancelled wait takes nothing and holds no one up."""
        n = min(max(size, 0), self.max_bytes)
        if not self._waiters and self.used + n <= self.max_bytes:
            self.used += n
            return n
        self.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(n)
            else:  # out of the line (if a release has not dropped it already); those behind may fit now
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._grant()
            raise
        return n

    def release(self, n: int) -> None:
        """Give back ``n`` granted bytes and grant the waiters, in order, that now fit."""
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            size, fut = self._waiters[0]
            if fut.done():  # cancelled, its task not yet resumed to leave the line
                self._waiters.popleft()
                continue
            if self.used + size > self.max_bytes:
                break
            self._waiters.popleft()
            self.used += size
            fut.set_result(None)
