"""Migrations and interrupts: moving an in-flight request between instances, or stopping it with
its partial output kept.

WHY a component of its own: a move is a small protocol of its own (KV export/import where both
engines support it, else abort at the source and resubmit prompt + partial output at the
destination, DESIGN section 4.6; a workflow's trajectory moves the turn it is generating the same
way, :mod:`.turns`) and it owns what a switch must wait for: the moves onto and off
each instance (:meth:`Migrations.pending`). It reports what happened on the event queue
(:class:`~dora_megatron.events.EngineReply`, :class:`MigrationDone`,
:class:`MigrationFailed`, :class:`InstanceFailed`); the samples stay the executor's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from dora_megatron.controller.errors import is_comm_error as _is_comm_error, is_local as _is_local
from dora_megatron.events import EngineReply, InstanceFailed, MigrationDone, MigrationFailed
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.controller.records import Engine
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.orchestrator import Interrupt, Migrate, Submit

if TYPE_CHECKING:
    from dora_megatron.controller.generation import Generation
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.controller.turns import Turns
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.workflow.runner import WorkflowRunner

log = logging.getLogger(__name__)


async def abort_until_returned(engine: Engine, sample_id: str, prev: asyncio.Task[Any] | None) -> None:
    """Abort ``sample_id`` until its in-flight ``/generate`` (``prev``) has returned.

    WHY repeat: an abort's answer proves nothing. SGLang answers 200 with an empty body whether or
    not anything matched, and drops the abort of a rid its tokenizer has not seen yet
    (tokenizer_manager.py ``abort_request``), which is the case while the ``/generate`` is still on
    its way; the embedded engine answers 404 then. Only the return of the generate says the abort
    took effect (or the request finished first). The wait between tries doubles from 20 ms to 1 s,
    so a long generation is not flooded with aborts."""
    await _abort_once(engine, sample_id)
    delay = 0.02
    while prev is not None and not prev.done():
        done, _ = await asyncio.wait([prev], timeout=delay)
        if done:
            break
        await _abort_once(engine, sample_id)
        delay = min(1.0, delay * 2)


async def _abort_once(engine: Engine, sample_id: str) -> None:
    """One abort; one that could not be sent for a local shortage (:func:`_is_local`) is simply
    tried again by the caller's next round (the instance is not at fault)."""
    try:
        await engine.abort(sample_id)
    except Exception as err:  # noqa: BLE001
        if not _is_local(err):
            raise
        log.debug("abort of %s not sent (local shortage): %s", sample_id, err)


class Migrations:
    """Carries out :class:`Migrate` and :class:`Interrupt` actions; ``controller``: the config's
    section (``migration``: kv or reprefill). ``generation`` orders every operation on a sample
    (``concurrent``), resubmits a migration's fallback and counts local shortages; ``turns``: a
    workflow's runs (one moved or interrupted mid-turn is dropped); ``store``: the samples (a
    finishing answer's reward is scored off the loop); ``tasks``: the clock; ``timeline``
    (None: none); ``workflow`` (``rollout.workflow``; None: single-turn requests)."""

    def __init__(self, controller: ControllerConfig, *, engines: dict[str, Engine], store: SampleStore,
                 events: EventQueue, generation: Generation, turns: Turns, tasks: RunTasks,
                 timeline: Timeline | None, workflow: WorkflowRunner | None) -> None:
        self.engines = engines
        self.store = store
        self.events = events
        self.generation = generation
        self.turns = turns
        self.tasks = tasks
        self.timeline = timeline
        self.workflow = workflow
        self.controller = controller
        # instance -> what a switch of it waits for: migrations into it (until they end), migrations
        # out of it (until the source let the request go) and interrupts
        self._moves_at: dict[str, set[asyncio.Future[Any]]] = {}
        self.migrated_bytes = 0
        self.migrations_done = 0
        self.migrations_fallback = 0
        # what the moves cost and what they free, in request-slot-seconds (the summary's
        # migration_stall_s / migration_freed_slot_s): the time a moved request made no progress
        # while it left its source (export, or abort until its generate returned), and the time it
        # then ran on at its destination, which it would otherwise have held a slot of its source
        # for; a freed source can switch versions only because of the latter
        self.stall_s = 0.0
        self.freed_slot_s = 0.0

    def migrate(self, a: Migrate) -> None:
        # A switch of the source waits only until the source has let the request go (exported, or
        # aborted with its partial output back), not for the move's task: that task lasts until
        # the request *finishes* at the destination (the import answers with the final response).
        # Waiting for it kept a freed instance idle through the whole tail of the requests moved
        # off it, which is the wait DORA's partition exists to remove. A switch of the destination
        # waits for the whole move.
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def release(_: asyncio.Task[None]) -> None:
            if not released.done():
                released.set_result(None)

        task = self.generation.concurrent(a.sample_id, lambda prev: self.move(a, prev, released), f"migrate-{a.sample_id}")
        task.add_done_callback(release)
        self._track_move(a.src, released)
        self._track_move(a.dst, task)

    def pending(self, instance: str) -> list[asyncio.Future[Any]]:
        """The moves onto and off ``instance`` (and its interrupts) not ended yet: a switch of it waits for them."""
        return [t for t in self._moves_at.get(instance, ()) if not t.done()]

    def _track_move(self, instance: str, fut: asyncio.Future[Any]) -> None:
        self._moves_at.setdefault(instance, set()).add(fut)
        fut.add_done_callback(lambda f: self._moves_at.get(instance, set()).discard(f))

    def interrupt(self, a: Interrupt) -> None:
        self.turns.drop(a.sample_id)  # an interrupted trajectory runs again from its prompt
        task = self.generation.concurrent(a.sample_id, lambda prev: self.abort(a, prev), f"interrupt-{a.sample_id}")
        self._track_move(a.instance, task)

    async def move(self, a: Migrate, prev: asyncio.Task[Any] | None, released: asyncio.Future[None]) -> None:
        """Move one request from ``a.src`` to ``a.dst``; ``released`` is set once the source no
        longer holds it (a switch of the source may then go ahead)."""
        from dora_megatron.comm.engine_client import EngineError

        rec = self.store.samples.get(a.sample_id)
        if rec is None or rec.finished:  # finished (its group maybe consumed) before this move ran
            return
        gate = None  # a workflow's run: the turn on the engine is what moves
        if self.workflow is not None:
            gate = self.turns.live(a.sample_id)
            if gate is not None and not gate.in_turn:  # its turn ended first: the orchestrator places its next turn
                return
        src, dst = self.engines[a.src], self.engines[a.dst]
        start = self.tasks.now()
        blob = None
        try:
            # a workflow whose run has not started yet (its submission waits for an earlier
            # operation) moves by abort + resubmit: there is no turn to carry
            use_kv = ((self.workflow is None or gate is not None) and self.controller.migration == "kv"
                      and await src.supports("export_request") and await dst.supports("import_request"))
            if use_kv:
                for _ in range(50):  # the generate may not have reached the engine yet
                    try:
                        blob = await src.export_request(a.sample_id)
                        break
                    except EngineError as err:
                        if err.status != 404:
                            raise
                        if rec.finished or (gate is not None and not gate.in_turn):
                            return  # it finished (its turn ended) first: nothing to move
                        await asyncio.sleep(0.02)
        except Exception as err:  # noqa: BLE001 - the source is unreachable: re-run the sample elsewhere
            if _is_local(err):  # the controller's shortage: move it the other way (abort + resubmit)
                self.generation.local_shortage(f"export of {a.sample_id} from {a.src}", err)
                blob = None
            elif not _is_comm_error(err):
                raise
            else:
                await self.events.report(InstanceFailed(a.src, f"export failed: {err}", src))
                await self.events.report(MigrationFailed(a.sample_id))
                return
        if blob is not None:
            released.set_result(None)  # the export removed it from the source
            left = self.tasks.now()
            self.stall_s += left - start
            self.migrated_bytes += len(blob)
            self.migrations_done += 1
            if self.timeline is not None:
                self.timeline.span(a.dst, f"migrate-in {a.sample_id}", start, self.tasks.now(), version=a.version, kind="migration")
            if gate is not None:
                gate.move_started(a.dst, dst)
            try:
                resp = await dst.import_request(blob)
            except Exception as err:  # noqa: BLE001 - the destination failed: its requests are re-queued
                if gate is not None:
                    gate.move_failed()  # the trajectory runs again from its prompt (re-queued below)
                if _is_local(err):  # the controller's shortage: the sample runs again from what it holds
                    self.generation.local_shortage(f"import of {a.sample_id} into {a.dst}", err)
                    await self.events.report(MigrationFailed(a.sample_id))
                    return
                if not _is_comm_error(err):
                    raise
                await self.events.report(InstanceFailed(a.dst, f"import failed: {err}", dst))
                return
            end = self.tasks.now()
            self.freed_slot_s += end - left
            if gate is not None:  # the turn's generate returns this; the trajectory goes on
                gate.move_landed(resp)
                return
            reward = await self.store.reward_off_loop(rec, resp)  # off the loop thread, before the report
            await self.events.report(EngineReply(a.sample_id, a.dst, resp, start, end, reward))
            return
        # Fallback (SGLang): abort at src, resubmit prompt + partial output at dst (re-prefill).
        if gate is not None:
            if not gate.in_turn:
                return  # its turn ended while the export was tried: the orchestrator places its next turn
            gate.drop()  # the trajectory runs again from its prompt at the destination
        try:
            await abort_until_returned(src, a.sample_id, prev)
        except Exception as err:  # noqa: BLE001
            if not _is_comm_error(err):
                raise
            await self.events.report(InstanceFailed(a.src, f"abort failed: {err}", src))
            await self.events.report(MigrationFailed(a.sample_id))
            return
        if prev is not None and not prev.done():
            await asyncio.wait([prev])  # the aborted generate's partial output is applied (absorb)
        released.set_result(None)  # aborted at the source, its partial output applied
        if rec.finished:
            return  # it finished before the abort reached it: nothing to move
        self.migrations_fallback += 1
        left = self.tasks.now()
        self.stall_s += left - start
        reprefill = len(rec.prompt_ids) + len(rec.response_ids)
        await self.events.report(MigrationDone(a.sample_id, reprefill))
        await self.generation.resubmit(Submit(a.sample_id, a.dst, a.version, resume=True))
        self.freed_slot_s += self.tasks.now() - left

    async def abort(self, a: Interrupt, prev: asyncio.Task[Any] | None) -> None:
        """Abort the request and wait until its partial output is back (before the instance switches)."""
        await abort_until_returned(self.engines[a.instance], a.sample_id, prev)
        if prev is not None and not prev.done():
            await asyncio.wait([prev])
