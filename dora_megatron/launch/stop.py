"""The first SIGINT / SIGTERM / SIGUSR1 stops a job at its next step boundary; the second at once.

WHY two stages: Ctrl-C, ``kill``, ``scancel`` and SLURM's time limit all mean "end this job", but
a job whose ``run.checkpoint_interval`` is 0 (or large) would lose every step since its start if
it ended at once. So the first signal asks the controller's runtime for a checkpoint at the next
step boundary (:meth:`~dora_megatron.controller.training.Training.request_stop`, bounded by
``controller.stop_checkpoint_timeout_s``) and the job then exits with the signal's status; a
second signal, or any signal while no runtime is running (startup, the final outputs), unwinds at
once as before (every child process is stopped on the way out). SIGUSR1 is SLURM's early warning
(``#SBATCH --signal=B:USR1@N`` in the templates): the same request, ``N`` seconds before the time
limit's SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

#: the signals that stop a job: the first one asks for a checkpoint, the second exits at once
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Stopped(KeyboardInterrupt):
    """A signal that ends the job at once, raised where the launcher is so that it unwinds (its
    children are stopped); ``signame`` names it (``SIGTERM``)."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


def exit_status(signame: str) -> int:
    """The shell's status of a process ended by ``signame`` (128 + its number: SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[signame])


class StopSignals:
    """While active (a context manager, main thread only), the :data:`STOP_SIGNALS`.

    ``first(signame)`` is called on the first signal while a target is :meth:`arm`\\ ed; it returns
    whether it took the request (False: unwind at once). Every other signal calls
    ``on_immediate(signame)`` (e.g. writes a FAILED marker) and raises :class:`Stopped`.
    ``received`` is the name of the first signal (None: none came)."""

    def __init__(self, on_immediate: Callable[[str], None] | None = None, signals=STOP_SIGNALS) -> None:
        self.on_immediate = on_immediate
        self.signals = tuple(signals)
        self.received: str | None = None
        self.count = 0
        self._target: Callable[[str], bool] | None = None
        self._previous: dict[int, object] = {}

    def arm(self, target: Callable[[str], bool]) -> None:
        self._target = target

    def disarm(self) -> None:
        self._target = None

    def arm_runtime(self, runtime) -> None:
        """Arm with ``runtime`` (a :class:`~dora_megatron.controller.runtime.Runtime` running on this
        thread's event loop): the request reaches it through the loop (``call_soon_threadsafe``),
        never in the middle of whatever the loop was doing when the signal came."""
        loop = asyncio.get_running_loop()

        def target(signame: str) -> bool:
            loop.call_soon_threadsafe(runtime.training.request_stop, signame)
            return True

        self.arm(target)

    def handle(self, signum: int, frame=None) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.received is None:
            self.received = name
        target = self._target
        if self.count == 1 and target is not None and target(name):
            log.warning("%s: the job stops at the next step boundary, after a checkpoint; "
                        "a second signal stops it at once", name)
            return
        if self.on_immediate is not None:
            self.on_immediate(name)
        raise Stopped(name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
