"""A workflow's trajectory between its turns: off the engine while its tool runs, placed again by
the orchestrator for its next turn.

WHY a component of its own: a trajectory is one sample to the orchestrator, but only its turns
need an engine slot. When a turn's ``generate`` returns, :class:`TurnGate` reports
:class:`~dora_megatron.events.TurnEnded` (the orchestrator frees the slot); when the
workflow asks for its next turn it reports :class:`~dora_megatron.events.TurnReady` and
waits for the ``Submit`` the orchestrator answers with, which may name another instance of the
trajectory's version. The workflow's coroutine lives through all of it in the sample's submission
task, so per-sample ordering is unchanged.

A move the orchestrator orders while a turn generates moves that turn's request like any
single-turn request (KV export/import, :mod:`.migration`): the source's answer says ``migrated``
and the turn's ``generate`` waits for the destination's answer (:meth:`TurnGate.moved`), so the
workflow goes on where it was. A trajectory interrupted during a turn, moved where the engines
cannot carry its KV, or re-queued while its turn's end was on its way (its instance failed), is
*dropped*: its events are no longer passed on (the orchestrator already placed the sample anew)
and its next step raises :class:`~dora_megatron.workflow.runner.TrajectoryAborted`, so the new
submission runs it again from its prompt on its version: nothing is kept of it twice, nothing lost.

Between turns the last turn's KV stays on its instance where the engine offers ``keep_kv`` (the
embedded engine; bounded there in time and blocks): a next turn placed on the same instance
computes only the tool's tokens; one placed on another instance of the version gets the prefix KV
carried there first (``/dora/export_kv`` then ``/dora/import_kv``, counted as
``workflow_turn_kv_moved``), or computes the prefix again when it cannot be carried (evicted,
expired, the instance failed, an engine without the transport: ``workflow_turn_prefix_recomputed``).
The kept KV is released when the trajectory's run ends, whatever ended it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.events import TurnEnded, TurnReady
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.records import Engine, SampleRecord
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.orchestrator import Submit
from dora_megatron.workflow.runner import TrajectoryAborted

if TYPE_CHECKING:
    from dora_megatron.controller.pool import Pool
    from dora_megatron.controller.samples import SampleStore

log = logging.getLogger(__name__)


class TurnGate:
    """One run of a sample's workflow (:class:`~dora_megatron.workflow.runner.TurnHost`):
    ``instance``/``engine`` are those of its current (or last) turn; ``turns``: the component that
    opened it (its clients, queue, recorder and clock, and the counts of the KV carried between turns)."""

    def __init__(self, turns: Turns, rec: SampleRecord, instance: str, engine: Engine) -> None:
        self.turns = turns
        self.rec = rec
        self.instance = instance
        self.engine = engine
        self.dropped = False
        self.closed = False
        self.waiting: asyncio.Future[Submit] | None = None  # the next turn's placement, once asked for
        self.turn_start = turns.tasks.now()
        self.in_turn = True  # a turn's request is on an engine (from the submission until it returns)
        # the destinations' answers of the turns moved mid-generation, in the order of the moves
        # (:meth:`moved`); an exception: the move failed, the trajectory is dropped
        self._moved: asyncio.Queue[tuple[Engine, GenerateResponse | BaseException]] = asyncio.Queue()
        self._moves = 0  # moves of its turns started; those whose answer was taken: _moves_taken
        self._moves_taken = 0
        self.keeping = False  # the current turn was sent with keep_kv
        self.kept_at: tuple[str, Engine] | None = None  # where the last turn's KV is kept

    async def keep_kv(self) -> bool:
        try:
            self.keeping = bool(await self.engine.supports("keep_kv"))
        except Exception:  # noqa: BLE001 - unknown: the turn is sent without it (the generate finds out)
            self.keeping = False
        return self.keeping

    async def ended(self) -> None:
        self.in_turn = False
        if self.keeping:
            self.kept_at = (self.instance, self.engine)
        self.turns.metrics.request_held_slot(self.turn_start, self.turns.tasks.now())  # (rollout_utilization)
        self.rec.gen_instance = None  # off the engine: a failure of that instance no longer concerns it
        await self.turns.events.report(TurnEnded(self.rec.sample_id, self))
        if self.dropped:
            raise TrajectoryAborted(self.rec.sample_id)

    async def next(self) -> tuple[Engine, int]:
        if self.dropped:
            raise TrajectoryAborted(self.rec.sample_id)
        self.waiting = asyncio.get_running_loop().create_future()
        await self.turns.events.report(TurnReady(self.rec.sample_id, self))
        a: Submit = await self.waiting
        self.waiting = None
        if self.dropped:  # moved or interrupted as soon as it was placed: the new submission runs it
            raise TrajectoryAborted(self.rec.sample_id)
        rec = self.rec
        moved = a.instance != self.instance
        self.instance, self.engine = a.instance, self.turns.engines[a.instance]
        rec.gen_instance = a.instance
        if moved and a.version == rec.version:
            await self.turns.carry_kv(self)
        self.turn_start = self.turns.tasks.now()
        self.in_turn = True
        if a.version != rec.version:  # partial mode placed it on newer weights: it runs again on them
            rec.versions.clear()
            rec.versions.add(a.version)
            rec.version = a.version
        return self.engine, a.version

    async def moved(self) -> tuple[Engine, GenerateResponse]:
        """The turn's request left its instance (its answer there said ``migrated``): the engine
        it was moved to and that engine's answer to it (:meth:`move_landed`)."""
        engine, resp = await self._moved.get()
        self._moves_taken += 1
        if isinstance(resp, BaseException):
            raise resp
        return engine, resp

    def move_started(self, instance: str, engine: Engine) -> None:
        """The turn's request was exported from its instance and goes to ``instance``: a failure of
        that instance concerns it from now on, and its answer will come from there."""
        self.instance, self.engine = instance, engine
        self.rec.gen_instance = instance
        self._moves += 1

    def moving(self) -> bool:
        """Whether the turn was exported to another instance and its answer there is still to be
        taken: the source's failure to answer (it died after the export) is then not the turn's."""
        return self._moves > self._moves_taken

    def move_landed(self, resp: GenerateResponse) -> None:
        """The destination answered the moved turn (maybe ``migrated`` again: moved on from there)."""
        self._moved.put_nowait((self.engine, resp))

    def move_failed(self) -> None:
        """The moved turn never reached an answer (its destination failed): the trajectory is dropped."""
        self.drop()

    def drop(self) -> None:
        self.dropped = True
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(TrajectoryAborted(self.rec.sample_id))
        self._moved.put_nowait((self.engine, TrajectoryAborted(self.rec.sample_id)))


class Turns:
    """Opens and closes the runs of the samples' workflows; a sample's current run is its record's
    ``turn`` (forgotten with the record). ``engines``, ``events``, ``metrics`` (the slot time of
    each turn) and ``tasks`` (the clock, the release of kept KV) are what its runs use; ``store``:
    the outstanding samples, each with its current run; ``pool``: whether an instance that keeps
    KV is still current."""

    def __init__(self, *, engines: dict[str, Engine], events: EventQueue, metrics: MetricsRecorder,
                 store: SampleStore, pool: Pool, tasks: RunTasks) -> None:
        self.engines = engines
        self.events = events
        self.metrics = metrics
        self.store = store
        self.pool = pool
        self.tasks = tasks
        self.kv_moved = 0  # next turns placed on another instance that got the prefix KV carried there
        self.kv_moved_bytes = 0
        self.prefix_recomputed = 0  # next turns placed on another instance that compute the prefix again

    def open(self, rec: SampleRecord, instance: str, engine: Engine) -> TurnGate:
        """A new run of ``rec``'s workflow, its first turn on ``instance``; an earlier run is dropped."""
        if rec.turn is not None:
            rec.turn.drop()
        gate = rec.turn = TurnGate(self, rec, instance, engine)
        return gate

    def close(self, gate: TurnGate) -> None:
        """The run ended (finished, failed or aborted); its record keeps where its last turn ran.
        The KV its last turn left on an instance is released there."""
        gate.closed = True
        if gate.kept_at is not None:
            instance, engine = gate.kept_at
            gate.kept_at = None
            self.tasks.spawn(self._release(instance, engine, gate.rec.sample_id), f"release-kv-{gate.rec.sample_id}")

    async def _release(self, instance: str, engine: Engine, rid: str) -> None:
        if not self.pool.is_current(instance, engine):
            return  # failed or replaced: its memory went with it
        try:
            await engine.release_kv(rid)
        except Exception as err:  # noqa: BLE001 - best effort: the engine's own bound frees it anyway
            log.debug("release of the kept KV of %s on %s failed: %s", rid, instance, err)

    async def carry_kv(self, gate: TurnGate) -> None:
        """``gate``'s next turn was placed on another instance than its last one: carry the kept
        prefix KV there (counted), else the prefix is computed again there (counted)."""
        kept, gate.kept_at = gate.kept_at, None
        rid = gate.rec.sample_id
        if kept is not None and self.pool.is_current(*kept):
            src_name, src = kept
            try:
                if await gate.engine.supports("keep_kv"):
                    blob = await src.export_kv(rid)
                    await gate.engine.import_kv(blob)
                    self.kv_moved += 1
                    self.kv_moved_bytes += len(blob)
                    return
                await src.release_kv(rid)
            except Exception as err:  # noqa: BLE001 - evicted, expired, no room, unreachable: recompute
                log.debug("the prefix KV of %s did not move from %s to %s (%s): computed again", rid, src_name,
                          gate.instance, err)
        self.prefix_recomputed += 1

    #: the summary's (and a checkpoint's) name of each count
    COUNTS = {"workflow_turn_kv_moved": "kv_moved", "workflow_turn_kv_moved_bytes": "kv_moved_bytes",
              "workflow_turn_prefix_recomputed": "prefix_recomputed"}

    def summary(self) -> dict[str, int]:
        return {key: getattr(self, attr) for key, attr in self.COUNTS.items()}

    def load(self, counts: dict[str, int]) -> None:
        """The counts of :meth:`summary` a checkpoint kept (a resumed run goes on counting from them)."""
        for key, attr in self.COUNTS.items():
            setattr(self, attr, int(counts[key]))

    def live(self, sample_id: str) -> TurnGate | None:
        """The sample's current run (opened, not ended nor dropped), None without one."""
        return self._live(sample_id)

    def _live(self, sample_id: str) -> TurnGate | None:
        rec = self.store.samples.get(sample_id)
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
        """The orchestrator interrupted the sample during a turn (or moved it where its KV cannot
        go): its run is dropped."""
        gate = self._live(sample_id)
        if gate is not None:
            gate.drop()

    def current(self, sample_id: str, gate: object) -> bool:
        """Whether an event of ``gate`` is still the sample's (the loop passes only those on)."""
        return gate is not None and self._live(sample_id) is gate

    @staticmethod
    def where(rec: SampleRecord, instance: str, engine: Engine) -> tuple[str, Engine]:
        """The instance and engine of the last turn of ``rec``'s trajectory (``instance``/``engine``,
        those it was submitted to, without a workflow)."""
        gate = rec.turn
        return (gate.instance, gate.engine) if gate is not None else (instance, engine)
