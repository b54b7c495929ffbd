"""The controller's main loop: event -> orchestrator -> actions -> executor, one at a time.

Read this file first. Everything that happens during ``dora train`` is an event on one
:class:`EventQueue`; :class:`ControllerLoop` takes them in order, feeds each to the sans-IO
:class:`~dora_megatron.orchestrator.Orchestrator` and hands the actions it returns to the
executor (:class:`~dora_megatron.controller.runtime.Runtime`), which starts HTTP calls as asyncio
tasks. Those tasks never call the orchestrator: when a call returns they put what happened on the
queue. Nothing but this loop calls the orchestrator's event methods.

::

    engine replies, stats, timers,          +-----------------------+
    trainer results, joins, failures  --->  |  EventQueue (FIFO)    |
            ^                               +-----------+-----------+
            |                                           v
            |                       ControllerLoop.feed(event) -> Orchestrator.on_...(...)
            |                                           |  list[Action]
            |                                           v
            +----- asyncio tasks <----- Runtime (ActionHandler): dispatch, submit, migrate, ...

WHY every state change happens here: the executor's per-sample records (tokens, reward, the
journal line) and the orchestrator's view of the same sample change in the same loop turn, so a
checkpoint (written while handling :class:`CheckpointSaved`) never holds a sample the runtime
calls finished and the orchestrator does not. WHY a task ``await``\\ s :meth:`EventQueue.report`:
a sample's next operation waits for the previous one's task (per-sample ordering, see
:mod:`.runtime`); a task that has returned has therefore had its event applied, e.g. the partial
output of an interrupted request is in the record before it is resubmitted. A task cancelled
before its event was handled (its instance failed meanwhile) withdraws the event, as a cancelled
HTTP call would never have reported.

The event dataclasses and :class:`~dora_megatron.events.EventMapping` (the mapping onto the
orchestrator) live in :mod:`dora_megatron.events`, below this loop and the simulator alike; this
module adds only the queue and the loop that reads it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dora_megatron.events import Event, EventMapping, Executor
from dora_megatron.orchestrator import Orchestrator

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- queue
class EventQueue:
    """The single FIFO the loop reads. ``post`` from anywhere on the event-loop thread;
    ``await report(...)`` from a task that must not go on before its event was applied."""

    def __init__(self) -> None:
        self._q: asyncio.Queue[tuple[Event, asyncio.Future[None] | None, asyncio.Task[Any] | None]] = asyncio.Queue()
        self._closed = False

    def post(self, event: Event) -> None:
        self._q.put_nowait((event, None, None))

    async def report(self, event: Event) -> None:
        """Queue ``event`` and wait until the loop applied it. After :meth:`close` (the loop has
        ended) the reporting task is cancelled instead: nobody will ever apply the event."""
        if self._closed:
            raise asyncio.CancelledError(f"the controller loop has ended: {type(event).__name__} not applied")
        fut = asyncio.get_running_loop().create_future()
        self._q.put_nowait((event, fut, asyncio.current_task()))
        await fut

    def close(self) -> None:
        """The loop has ended: cancel every report still waiting, and any later one.

        WHY: at shutdown the runtime cancels its tasks, but on Python 3.11 ``asyncio.wait_for``
        can swallow a cancellation that arrives as its inner call completes (fixed in 3.12). A
        request task that lost its cancel that way went on to report its reply and waited forever
        for a loop that had stopped (a test run hung once in CI)."""
        self._closed = True
        while not self._q.empty():
            _, fut, _ = self._q.get_nowait()
            if fut is not None and not fut.done():
                fut.cancel()

    async def get(self) -> tuple[Event, asyncio.Future[None] | None, asyncio.Task[Any] | None]:
        return await self._q.get()

    def __len__(self) -> int:
        return self._q.qsize()


# ---------------------------------------------------------------------------------------- the loop
class ControllerLoop(EventMapping):
    """Reads ``events`` until ``done`` is set; the only caller of the orchestrator's event methods
    in a run (:class:`EventMapping` is the mapping)."""

    def __init__(self, orch: Orchestrator, executor: Executor, events: EventQueue, done: asyncio.Event) -> None:
        super().__init__(orch, executor)
        self.events = events
        self.done = done

    async def run(self) -> None:
        try:
            while not self.done.is_set():
                event, fut, origin = await self.events.get()
                if fut is not None and fut.done():
                    continue  # its task was cancelled before the event was applied: withdrawn
                try:
                    self.step(event, origin)
                except BaseException as err:
                    if fut is not None and not fut.done():
                        fut.cancel()
                    raise err
                if fut is not None and not fut.done():
                    fut.set_result(None)
        finally:
            self.events.close()  # what reports from now on is never applied: its task is cancelled
