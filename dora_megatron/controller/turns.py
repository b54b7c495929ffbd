"""A workflow's trajectory between its turns: off the engine while its tool runs, placed again by
the orchestrator for its next turn.

WHY a component of its own: a trajectory is one sample to the orchestrator, but only its turns
need an engine slot. When a turn's ``generate`` returns, :class:`TurnGate` reports
:class:`~dora_megatron.controller.loop.TurnEnded` (the orchestrator frees the slot); when the
workflow asks for its next turn it reports :class:`~dora_megatron.controller.loop.TurnReady` and
waits for the ``Submit`` the orchestrator answers with, which may name another instance of the
trajectory's version (the prefix is computed again there). The workflow's coroutine lives through
all of it in the sample's submission task, so per-sample ordering is unchanged.

A trajectory the orchestrator moved or interrupted during a turn, or re-queued while its turn's
end was on its way (its instance failed), is *dropped*: its events are no longer passed on (the
orchestrator already placed the sample anew) and its next step raises
:class:`~dora_megatron.workflow.runner.TrajectoryAborted`, so the new submission runs it again
from its prompt on its version: nothing is kept of it twice, nothing lost.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from dora_megatron.controller.loop import EventQueue, TurnEnded, TurnReady
from dora_megatron.controller.records import Engine, SampleRecord
from dora_megatron.orchestrator import Submit
from dora_megatron.workflow.runner import TrajectoryAborted


class TurnsHost(Protocol):
    """What the turns use of the executor: its pool and its event queue."""

    engines: dict[str, Engine]
    samples: dict[str, SampleRecord]
    events: EventQueue
    metrics: Any  # :class:`~dora_megatron.observability.recorder.MetricsRecorder`: the slot time of each turn

    def now(self) -> float: ...


class TurnGate:
    """One run of a sample's workflow (:class:`~dora_megatron.workflow.runner.TurnHost`):
    ``instance``/``engine`` are those of its current (or last) turn."""

    def __init__(self, host: TurnsHost, rec: SampleRecord, instance: str, engine: Engine) -> None:
        self.host = host
        self.rec = rec
        self.instance = instance
        self.engine = engine
        self.dropped = False
        self.closed = False
        self.waiting: asyncio.Future | None = None  # the next turn's placement, once asked for
        self.turn_start = host.now()

    async def ended(self) -> None:
        self.host.metrics.request_held_slot(self.turn_start, self.host.now())  # (rollout_utilization)
        self.rec.gen_instance = None  # off the engine: a failure of that instance no longer concerns it
        await self.host.events.report(TurnEnded(self.rec.sample_id, self))
        if self.dropped:
            raise TrajectoryAborted(self.rec.sample_id)

    async def next(self) -> tuple[Any, int]:
        if self.dropped:
            raise TrajectoryAborted(self.rec.sample_id)
        self.waiting = asyncio.get_running_loop().create_future()
        await self.host.events.report(TurnReady(self.rec.sample_id, self))
        a: Submit = await self.waiting
        self.waiting = None
        if self.dropped:  # moved or interrupted as soon as it was placed: the new submission runs it
            raise TrajectoryAborted(self.rec.sample_id)
        rec = self.rec
        self.instance, self.engine = a.instance, self.host.engines[a.instance]
        rec.gen_instance = a.instance
        self.turn_start = self.host.now()
        if a.version != rec.version:  # partial mode placed it on newer weights: it runs again on them
            rec.versions.clear()
            rec.versions.add(a.version)
            rec.version = a.version
        return self.engine, a.version

    def drop(self) -> None:
        self.dropped = True
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(TrajectoryAborted(self.rec.sample_id))


class Turns:
    """Opens and closes the runs of the samples' workflows; a sample's current run is its record's
    ``turn`` (forgotten with the record)."""

    def __init__(self, host: TurnsHost) -> None:
        self.host = host

    def open(self, rec: SampleRecord, instance: str, engine: Engine) -> TurnGate:
        """A new run of ``rec``'s workflow, its first turn on ``instance``; an earlier run is dropped."""
        if rec.turn is not None:
            rec.turn.drop()
        rec.turn = TurnGate(self.host, rec, instance, engine)
        return rec.turn

    @staticmethod
    def close(gate: TurnGate) -> None:
        """The run ended (finished, failed or aborted); its record keeps where its last turn ran."""
        gate.closed = True

    def _live(self, sample_id: str) -> TurnGate | None:
        rec = self.host.samples.get(sample_id)
        gate = rec.turn if rec is not None else None
        return gate if gate is not None and not gate.closed and not gate.dropped else None

    def hand_over(self, a: Submit) -> bool:
        """``a`` places the next turn of a trajectory waiting for it: handed to that trajectory (True).
        A ``Submit`` of a sample whose trajectory is in flight but did not ask (the orchestrator
        re-queued it: its instance failed as its turn ended) drops that run; the submission then
        runs it again (False)."""
        gate = self._live(a.sample_id)
        if gate is None:
            return False
        if gate.waiting is not None and not gate.waiting.done():
            gate.waiting.set_result(a)
            return True
        gate.drop()
        return False

    def drop(self, sample_id: str) -> None:
        """The orchestrator moved or interrupted the sample during a turn: its run is dropped."""
        gate = self._live(sample_id)
        if gate is not None:
            gate.drop()

    def current(self, sample_id: str, gate: Any) -> bool:
        """Whether an event of ``gate`` is still the sample's (the loop passes only those on)."""
        return gate is not None and self._live(sample_id) is gate

    @staticmethod
    def where(rec: SampleRecord, instance: str, engine: Engine) -> tuple[str, Engine]:
        """The instance and engine of the last turn of ``rec``'s trajectory (``instance``/``engine``,
        those it was submitted to, without a workflow)."""
        gate = rec.turn
        return (gate.instance, gate.engine) if gate is not None else (instance, engine)
