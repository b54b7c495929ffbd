"""One background thread for the run's slow observability writes (pictures, rollout dumps).

Why: the controller's event loop drives every engine and the trainer; a matplotlib figure
(a second or more) or an fsynced dump file drawn in a loop turn holds every reply, dispatch and
weight switch for that long. The loop hands such work to :class:`BackgroundWriter` with
:meth:`~BackgroundWriter.submit` (cheap: a queue put) and goes on; one worker thread runs the
jobs in order (matplotlib's pyplot is not meant for several drawing threads at once; one thread
keeps that true). :meth:`~BackgroundWriter.close` at the end of the run waits for every job
submitted, so nothing is lost; a job that fails is logged with its traceback and counted, never
raised into the loop (every number a picture shows is already written elsewhere).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundWriter:
    """Runs submitted jobs ``fn(*args, **kwargs)`` in order on one daemon thread.

    ``pending`` caps the queue: when the thread falls that far behind (a disk that stalls),
    :meth:`submit` drops the job with a warning instead of growing without bound or blocking
    the loop. ``done`` / ``failed`` / ``dropped`` count the jobs."""

    def __init__(self, name: str = "dora-observability", pending: int = 256) -> None:
        if int(pending) < 1:
            raise ValueError(f"BackgroundWriter pending: {pending}; at least 1 job must be able to wait")
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=int(pending))
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._closed = False
        self.done = 0
        self.failed = 0
        self.dropped = 0
        self._thread.start()

    def submit(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Queue ``fn(*args, **kwargs)`` (``what`` names it in logs); False when it was not queued
        (the writer is closed, or its queue is full)."""
        if self._closed:
            log.warning("%s: %s submitted after close; not written", self.name, what)
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait((what, fn, args, kwargs))
        except queue.Full:
            self.dropped += 1
            log.warning("%s: %d jobs waiting; %s dropped", self.name, self._queue.maxsize, what)
            return False
        return True

    def flush(self) -> None:
        """Block until every job submitted so far has run."""
        self._queue.join()

    def close(self) -> None:
        """Run every job still queued, then stop the thread (idempotent). Blocks: call it after the
        event loop's work is over, or through ``asyncio.to_thread``."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                what, fn, args, kwargs = job
                try:
                    fn(*args, **kwargs)
                except Exception:  # noqa: BLE001 - a picture or a dump is for reading: the run goes on
                    self.failed += 1
                    log.exception("%s: %s failed; the run goes on", self.name, what)
                else:
                    self.done += 1
            finally:
                self._queue.task_done()
