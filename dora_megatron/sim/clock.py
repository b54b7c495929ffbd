"""The simulator's virtual clock: timed events popped in order, each handed to its handler, the
consequences drained before the next, until the run ends, time runs out or nothing moves.

WHY apart from the executor (:mod:`.engine`): the loop is what makes a run a pure function of its
config and seed (:class:`~.events.EventQueue` breaks ties by insertion order); keeping it free of
what the events mean lets a reader check that property, and the stall rule, in one place.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from dora_megatron.sim.events import EventQueue

log = logging.getLogger(__name__)

# the kinds of timed event (their payloads: see the handlers in sim/engine.py)
WAKE, SWITCH_DONE, ARRIVE, TRAIN_DONE, POLL, TOOL_DONE = "wake", "switch_done", "arrive", "train_done", "poll", "tool"


class VirtualClock:
    """Runs the timed events of ``q``; ``last_progress`` is when something last happened (the
    handlers mark it too), from which a stall is told."""

    def __init__(self, q: EventQueue, poll_interval_s: float, max_time_s: float) -> None:
        self.q = q
        self.poll_interval_s = poll_interval_s
        self.max_time_s = max_time_s
        self.last_progress = 0.0

    def progressed(self) -> None:
        self.last_progress = self.q.now

    def run(self, handlers: Mapping[str, Callable[[Any], None]], on_poll: Callable[[], None],
            drain: Callable[[], None], done: Callable[[], bool], idle: Callable[[], bool]) -> bool:
        """Pop events until ``done()``, the queue empties or the time limit passes; after each,
        ``drain()`` its consequences. Returns True on a stall: at a poll, nothing happened for
        ``max(60 s, 50 polls)`` and ``idle()`` (no work in flight, the trainer waiting)."""
        self.q.push(self.poll_interval_s, POLL)
        stall_limit = max(60.0, 50 * self.poll_interval_s)
        while not done() and len(self.q):
            t, kind, payload = self.q.pop()
            if t > self.max_time_s:
                break
            if kind == POLL:
                on_poll()
            else:
                self.last_progress = t
                handlers[kind](payload)
            drain()
            if kind == POLL and t - self.last_progress > stall_limit and idle():
                log.error("simulation stalled at t=%.1fs: no work in flight and the trainer idle", t)
                return True
        return False
