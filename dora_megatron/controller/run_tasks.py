"""The run's tasks, its clock and its end: what every component of the controller uses to start
work (:meth:`RunTasks.spawn`), to time it (:meth:`RunTasks.now`) and to end the run
(:meth:`RunTasks.stop`).

WHY an object of its own: every component needs these four and nothing else of the executor that
owns them. Handed this (typed) instead of the runtime, a component names exactly what it uses,
and the runtime keeps only the mapping of actions and events onto its components.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Coroutine

from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.shutdown import cancel_in_batches
from dora_megatron.events import Stop

log = logging.getLogger(__name__)


class RunTasks:
    """The asyncio tasks of one run, its clock and its end (the first error wins); ``events``: the
    queue of the loop, which :meth:`stop` wakes."""

    def __init__(self, events: EventQueue) -> None:
        self.events = events
        #: the wall time of the run resumed from (0.0: a new run): the clock goes on from it
        self.resumed_from_s = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self._t0 = 0.0

    def start_clock(self) -> None:
        """The run starts now (:meth:`~dora_megatron.controller.runtime.Runtime.begin`)."""
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Seconds of the run (a resumed run goes on from its checkpoint's wall time)."""
        return time.monotonic() - self._t0 + self.resumed_from_s

    def spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[None]:
        """A task of the run: its failure stops the run with its cause; :meth:`cancel_all` cancels it."""
        task = asyncio.get_running_loop().create_task(self._guard(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro: Coroutine[Any, Any, object]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - any failure stops the run with its cause
            log.exception("runtime task failed")
            self.stop(err)

    @property
    def running(self) -> tuple[asyncio.Task[None], ...]:
        """The tasks of the run that have not ended yet."""
        return tuple(self._tasks)

    async def cancel_all(self) -> None:
        """Cancel every task of the run, a batch per loop turn (:func:`~.shutdown.cancel_in_batches`),
        and wait until each has ended."""
        await cancel_in_batches(list(self._tasks))

    @property
    def ended(self) -> asyncio.Event:
        """Set once the run ends (:meth:`stop`): a :class:`~dora_megatron.controller.loop.ControllerLoop`
        runs until it is."""
        return self._done

    def is_done(self) -> bool:
        """Whether the run was ended (:meth:`stop`): a supervisor stops acting on it then."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What ended the run, the first error given to :meth:`stop` or :meth:`fail` (None: none so far)."""
        return self._error

    def fail(self, error: BaseException) -> None:
        """Record ``error`` as the run's unless it has one already (the first wins); nothing else."""
        if self._error is None:
            self._error = error

    def stop(self, error: BaseException | None = None) -> None:
        """End the run (with ``error``, the first one wins): the loop stops after its current event."""
        if error is not None:
            self.fail(error)
        self._done.set()
        self.events.post(Stop())
