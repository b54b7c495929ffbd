"""The engine thread: runs scheduler steps and executes commands between them.

Why a thread with a command queue: the aiohttp handlers must stay responsive while the model
runs, and all scheduler state must be touched by one thread only. Handlers submit callables
(:meth:`EngineRunner.call`); the engine thread runs them between steps and resolves asyncio
futures with ``loop.call_soon_threadsafe``. Weight updates use :meth:`call_when_idle`: as in
SGLang, unless generation is paused they wait until running and queued requests have finished,
while newly arriving requests are held back until the update is done.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from dora_megatron.rollout.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

Command = Callable[[Scheduler], Any]


class EngineRunner:
    def __init__(self, scheduler: Scheduler, loop: asyncio.AbstractEventLoop, idle_wait_s: float = 0.05) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.idle_wait_s = idle_wait_s
        self._queue: "queue.Queue[tuple[Command, asyncio.Future, bool]]" = queue.Queue()
        self._deferred: list[tuple[Command, asyncio.Future]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="dora-engine", daemon=True)
        self.snapshot: dict[str, Any] = scheduler.info()
        self.last_error: str | None = None
        self._hold_results = False
        self._pending: list[Callable[[], None]] = []

    # ---- called from the event loop ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Command) -> "asyncio.Future[Any]":
        fut = self.loop.create_future()
        self._queue.put((fn, fut, False))
        return fut

    def call_when_idle(self, fn: Command) -> "asyncio.Future[Any]":
        fut = self.loop.create_future()
        self._queue.put((fn, fut, True))
        return fut

    def resolve(self, fut: "asyncio.Future[Any]", value: Any = None, exc: BaseException | None = None) -> None:
        """Thread-safe completion of an asyncio future."""

        def _set() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        if self._hold_results:
            self._pending.append(_set)  # released after the snapshot is refreshed
        else:
            self.loop.call_soon_threadsafe(_set)

    def _release_results(self) -> None:
        self._hold_results = False
        pending, self._pending = self._pending, []
        for cb in pending:
            self.loop.call_soon_threadsafe(cb)

    # ---- engine thread -------------------------------------------------------------------
    def _execute(self, fn: Command, fut: "asyncio.Future[Any]") -> None:
        self._hold_results = True
        try:
            result, error = fn(self.scheduler), None
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            result, error = None, exc
        self.snapshot = self.scheduler.info()
        self._release_results()
        self.resolve(fut, result, error)

    def _run_deferred(self) -> None:
        s = self.scheduler
        while self._deferred and (s.is_idle() or s.paused is not None):
            fn, fut = self._deferred.pop(0)
            self._execute(fn, fut)
        if not self._deferred and s.hold_admission:
            s.release_held()
        elif self._deferred:
            s.hold_admission = True

    def _handle(self, item: tuple[Command, "asyncio.Future[Any]", bool]) -> None:
        fn, fut, when_idle = item
        if when_idle:
            self._deferred.append((fn, fut))
        else:
            self._execute(fn, fut)

    def _main(self) -> None:
        s = self.scheduler
        while not self._stop.is_set():
            try:
                while True:
                    self._handle(self._queue.get_nowait())
            except queue.Empty:
                pass
            self._run_deferred()
            if s.can_step():
                self._hold_results = True
                try:
                    s.step()
                except Exception as exc:  # noqa: BLE001 - keep serving; fail the batch
                    log.exception("engine step failed; aborting running requests")
                    self.last_error = repr(exc)
                    s.fail_running(f"engine error: {exc!r}")
            else:
                try:
                    self._handle(self._queue.get(timeout=self.idle_wait_s))
                except queue.Empty:
                    pass
            self.snapshot = s.info()
            self._release_results()
