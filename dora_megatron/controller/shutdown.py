"""Ending a run that has thousands of requests in flight without stopping the event loop for a second.

WHY: at the paper's shape (128 instances x 64 slots) the run's end finds 8,192 ``/generate``
tasks in flight, each holding about 80 objects the garbage collector tracks (its coroutines,
aiohttp's request, response, parser, transport and timers). Cancelled all at once, their clean-up
(each closes its socket) ran in one loop turn: 0.6 s of the loop's CPU. A full collection starting
during the abort scanned every one of those objects: 0.73 s with the loop stopped
(``tools/controller_scale.py``'s ``long_stalls``, ``docs/results/controller_scale.md``). Cancelled a
batch per loop turn, and with the collector paused while they unwind, the loop keeps turning; what
they leave is collected afterwards, from a heap that no longer holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterable, Iterator

#: tasks cancelled per loop turn at the run's end
CANCEL_BATCH = 256


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside (each full one would scan every in-flight request's
    objects while they are being dropped); the collector's previous state is restored after, so a
    process that had it off keeps it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def cancel_in_batches(tasks: Iterable[asyncio.Task[None]], batch: int = CANCEL_BATCH) -> None:
    """Cancel ``tasks``, ``batch`` of them per loop turn, then wait until all have ended (their
    errors are theirs: a cancelled task's failure is not the caller's)."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    pending = list(tasks)
    for start in range(0, len(pending), batch):
        for task in pending[start:start + batch]:
            task.cancel()
        await asyncio.sleep(0)  # the loop runs this batch's clean-up before the next is cancelled
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
