"""At most so many request starts per turn of the event loop.

WHY: the orchestrator's plan can submit thousands of requests at once (at the start of a run and
after every weight switch: 64 instances x 64 slots are 4,096). Each becomes a task, and asyncio
runs every task made ready in one turn before it looks at its sockets and timers again; starting a
request (its body, a connection: socket, connect, register) costs ~0.3 ms of the loop's CPU, so a
wave of 4,096 held the loop for 1.2 s of its own CPU in one turn, every dispatch, answer and stats
poll of the cluster waiting behind it (``docs/results/controller_scale.md``, the long stalls).
Through a :class:`TurnPacer` the wave is spread over turns of ``per_turn`` starts, with the loop's
I/O and timers served between two of them; what the requests do after they started is unchanged.
"""

from __future__ import annotations

import asyncio
from collections import deque

#: request starts let through per event-loop turn (~5 ms of the loop's CPU at ~0.3 ms each): with 64
#: the wave still held the loop ~100-240 ms of CPU between two ticks on the loaded 2-core machine,
#: with 16 it left no stall of 500 ms (docs/results/controller_scale.md)
STARTS_PER_TURN = 16


class TurnPacer:
    """:meth:`turn` returns at once while fewer than ``per_turn`` callers passed since the loop's
    last turn and nobody waits (a few requests start as before, with no delay); later callers
    wait, first come first served, and ``per_turn`` of them resume a turn. A turn may start up to
    twice ``per_turn``: waiters released for it and new callers of the turn before."""

    def __init__(self, per_turn: int = STARTS_PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, got {per_turn}")
        self.per_turn = per_turn
        self._passed = 0  # callers let through (or released) since the last reset
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._reset_scheduled = False

    async def turn(self) -> None:
        if self._passed < self.per_turn and not self._waiting:
            self._passed += 1
            self._schedule_reset()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._schedule_reset()
        await fut  # cancelled while waiting: it takes no room (done futures are skipped)

    def _schedule_reset(self) -> None:
        if not self._reset_scheduled:
            self._reset_scheduled = True
            # call_soon from inside a turn runs in the next one, after the loop polled its sockets
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """Once a turn while there is anything to count: up to ``per_turn`` waiters resume (in the next turn)."""
        self._reset_scheduled = False
        self._passed = 0
        while self._waiting and self._passed < self.per_turn:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self._passed += 1
        if self._waiting or self._passed:
            self._schedule_reset()
