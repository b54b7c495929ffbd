"""Generation: the samples' requests from dispatch to the engine's answer (submit, per-sample
ordering, the workflow's turns, the reply applied to the sample's record).

WHY a component of its own: a submission is the controller's hot path and has rules of its own:
each sample has at most one HTTP operation in flight, a new one (a resubmission after an
interrupt, a migration) first awaits the previous one so partial outputs are never lost or applied
twice; a refusal by the engine's C1 guard is re-queued, and an instance that keeps refusing its
own version is failed; a failure for the controller's own shortage (no descriptor, no pooled
connection) is retried, never counted against the instance. The executor
(:class:`~dora_megatron.controller.runtime.Runtime`) hands it ``Dispatch`` and ``Submit``
actions and the :class:`~dora_megatron.events.EngineReply` events; what happened goes on
the event queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Mapping

from dora_megatron.comm.batch_files import BatchFileError, compact_routed
from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.controller.errors import LOCAL_RETRY_S, is_comm_error as _is_comm_error, is_local as _is_local
from dora_megatron.events import EngineReply, InstanceFailed, MigrationFailed, Replayed
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.pacing import TurnPacer
from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.controller.records import Engine, SampleRecord
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.controller.siblings import DraftPushes, finished_sources, running_targets
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.orchestrator import Dispatch, Orchestrator, Submit
from dora_megatron.workflow.runner import WorkflowFailed, WorkflowReply

if TYPE_CHECKING:
    from dora_megatron.controller.journal import Journal
    from dora_megatron.controller.pool import Pool
    from dora_megatron.controller.replay import JournalReplay
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.controller.turns import Turns
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.workflow.runner import WorkflowRunner

log = logging.getLogger(__name__)

#: refusals in a row of requests routed for an instance's own version (no switch under way) after
#: which the instance is failed as out of step with the controller (:meth:`Generation._out_of_step`)
OUT_OF_STEP_REFUSALS = 3


class Generation:
    """Carries out :class:`Dispatch` and :class:`Submit` actions and applies engine answers
    (DESIGN section 5.3). ``rollout``: the request timeout and group speculation (``speculative``,
    ``spec_max_batch``); ``algo``: whether engines are asked for the routed experts
    (:attr:`~dora_megatron.config.algo.AlgoConfig.wants_routed_experts`); both the config's
    sections themselves. Its collaborators: ``store`` (the samples' records), ``pool`` (whether an
    instance is still current), ``turns`` (a workflow's trajectories between their turns),
    ``replay`` (the journal's finished samples on resume), ``orch`` (what it placed where, read
    only), ``tasks`` (the clock, per-sample tasks), ``journal`` and ``timeline`` (None: none),
    ``workflow`` (``rollout.workflow``; None: one ``/generate`` per submission)."""

    def __init__(self, rollout: RolloutConfig, algo: AlgoConfig, *, orch: Orchestrator, engines: dict[str, Engine],
                 store: SampleStore, events: EventQueue, metrics: MetricsRecorder, pool: Pool, turns: Turns,
                 replay: JournalReplay, tasks: RunTasks, timeline: Timeline | None, journal: Journal | None,
                 workflow: WorkflowRunner | None) -> None:
        self.orch = orch
        self.engines = engines
        self.store = store
        self.events = events
        self.metrics = metrics
        self.pool = pool
        self.turns = turns
        self.replay = replay
        self.tasks = tasks
        self.timeline = timeline
        self.journal = journal
        self.workflow = workflow
        self.rollout = rollout
        self.algo = algo
        self.version_refusals = 0
        self._refusal_streak: dict[str, int] = {}  # instance -> refusals in a row of its own version
        #: instances whose answers carry no routed_experts although asked for (same rule)
        self.routed_experts_off: set[str] = set()
        #: calls that failed for a shortage of the controller's own process (EMFILE, ENOBUFS, a
        #: full pool): retried or re-queued, never counted against the instance
        self.local_resource_errors = 0
        self.pacer = TurnPacer()  # request starts per loop turn
        self.drafts = DraftPushes(engines, tasks.spawn, self._may_push)  # rollout.speculative=group's pushes

    def dispatch(self, a: Dispatch) -> None:
        group = self.store.dispatch(a)
        if self.journal is not None:
            self.journal.dispatch(a.group_id, a.version, group.prompt.index, list(a.sample_ids))
        self.replay.restore(a.group_id)

    def prompt_tokens(self, group_id: str) -> int:
        """Loop: the prompt length of a dispatched group (the orchestrator's re-prefill accounting)."""
        return self.store.prompt_tokens(group_id)

    def submit(self, a: Submit) -> None:
        if self.turns.hand_over(a):  # the next turn of a trajectory in flight
            return
        self._chain(a.sample_id, self._submit(a), f"submit-{a.sample_id}")

    def _chain(self, sample_id: str, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[None]:
        """Run ``coro`` after the sample's previous operation finished (per-sample ordering)."""
        rec = self.store.samples[sample_id]
        prev = rec.task

        async def run() -> None:
            if prev is not None and not prev.done():
                await asyncio.wait([prev])
            await coro

        rec.task = self.tasks.spawn(run(), name)
        return rec.task

    def concurrent(self, sample_id: str, make_coro: Callable[[asyncio.Task[None] | None], Coroutine[Any, Any, object]],
                   name: str) -> asyncio.Task[None]:
        """Run an operation that acts on the sample's in-flight request (it does not wait for it);
        later operations on the sample wait for both."""
        rec = self.store.samples[sample_id]
        prev = rec.task
        task = self.tasks.spawn(make_coro(prev), name)

        async def both() -> None:
            await asyncio.wait([t for t in (prev, task) if t is not None])

        rec.task = self.tasks.spawn(both(), f"{name}-join")
        return task

    def local_shortage(self, what: str, err: BaseException) -> None:
        """Count a call that failed for the controller's own shortage; the first and every 1,000th are logged."""
        self.local_resource_errors += 1
        if self.local_resource_errors == 1 or self.local_resource_errors % 1000 == 0:
            log.warning("%s: a local resource shortage of the controller, not the instance's fault (retried; "
                        "%d so far, counted as local_resource_errors): %s", what, self.local_resource_errors, err)

    async def resubmit(self, a: Submit) -> None:
        """Run ``a`` in the calling task (a migration's fallback: the sample is resubmitted on its
        destination once its partial output is back)."""
        await self._submit(a)

    async def _submit(self, a: Submit) -> None:
        from dora_megatron.comm.engine_client import VersionMismatch

        # a wave of submits (a run's start, a weight switch) starts per_turn a loop turn (:mod:`.pacing`);
        # what the sample became meanwhile is read below
        await self.pacer.turn()
        rec = self.store.samples.get(a.sample_id)
        if rec is None:  # an earlier operation finished it and its group was consumed meanwhile
            return
        if rec.finished:
            if rec.replay_pending:
                await self.events.report(Replayed(a.sample_id))
            return
        rec.submissions += 1
        if self.workflow is not None:  # a workflow's trajectory runs whole again: nothing of an earlier version is kept
            rec.versions.clear()
        rec.versions.add(a.version)
        rec.version = a.version
        engine = self.engines[a.instance]
        rec.gen_task, rec.gen_instance = asyncio.current_task(), a.instance
        delay, deadline = LOCAL_RETRY_S[0], time.monotonic() + self.rollout.request_timeout_s
        while True:
            start = self.tasks.now()
            try:
                try:
                    resp = await self._generate(engine, rec, a)
                except Exception:
                    a, engine = self._last_turn(rec, a, engine)  # a workflow's later turn may have run elsewhere
                    raise
                break
            except VersionMismatch as err:
                # the engine's C1 guard refused it (it holds another version): nothing ran, re-queue it
                log.warning("C1 guard: %s refused %s for version %d: %s", a.instance, a.sample_id, a.version,
                            err.message)
                self.version_refusals += 1
                if self._out_of_step(a.instance, a.version):
                    await self.events.report(InstanceFailed(
                        a.instance, f"serves another weight version than the {a.version} it was switched to "
                        f"({OUT_OF_STEP_REFUSALS} requests in a row refused: {err.message})", engine))
                else:
                    await self.events.report(MigrationFailed(a.sample_id))
                return
            except WorkflowFailed as err:
                if err.final:
                    raise
                await self.events.report(MigrationFailed(a.sample_id))  # its environment crashed: run it again
                return
            except Exception as err:  # noqa: BLE001
                if _is_local(err):
                    # the controller's own shortage (no descriptor, no pooled connection): the instance
                    # is not at fault; the same call is tried again after a back-off
                    self.local_shortage(f"generate of {a.sample_id} on {a.instance}", err)
                    if not self.pool.is_current(a.instance, engine):
                        return  # failed or replaced meanwhile: its requests are re-queued already
                    if self.workflow is not None or time.monotonic() + delay > deadline:
                        # short for a whole request timeout, or a trajectory (its turns are placed by the
                        # orchestrator, not retried here): run it later
                        await self.events.report(MigrationFailed(a.sample_id))
                        return
                    await asyncio.sleep(delay)
                    delay = min(LOCAL_RETRY_S[1], delay * 2)
                    continue
                if not _is_comm_error(err):
                    raise
                await self.events.report(InstanceFailed(a.instance, f"generate failed: {err}", engine))
                return
        a, engine = self._last_turn(rec, a, engine)
        self._refusal_streak.pop(a.instance, None)
        end = self.tasks.now()
        reward = await self.store.reward_off_loop(rec, resp)  # off the loop thread, before the report
        await self.events.report(EngineReply(a.sample_id, a.instance, resp, start, end, reward))

    def _last_turn(self, rec: SampleRecord, a: Submit, engine: Engine) -> tuple[Submit, Engine]:
        """``a`` naming the instance (and the engine) of the last turn of the sample's trajectory,
        where its answer or its failure came from (without a workflow: ``a``'s own)."""
        at, engine = self.turns.where(rec, a.instance, engine)
        return (a if at == a.instance else replace(a, instance=at)), engine

    async def _generate(self, engine: Engine, rec: SampleRecord, a: Submit) -> GenerateResponse | WorkflowReply:
        """One submission's answer: the engine's, or with ``rollout.workflow`` the whole trajectory
        its workflow generated on this instance with this version (every turn pinned to it)."""
        if self.workflow is None:
            return await engine.generate([*rec.prompt_ids, *rec.response_ids], self.store.sampling(rec),
                                         rid=a.sample_id, return_logprob=True, version=a.version,
                                         **({"routed_experts": True} if self.algo.wants_routed_experts else {}),
                                         **({"draft_sources": finished_sources(rec, self.store.siblings(rec))}
                                            if self.rollout.draft_siblings else {}))
        turn = self.turns.open(rec, a.instance, engine)
        try:
            return await self.workflow.run(engine, self.store.groups[rec.group_id].prompt, rec.prompt_ids,
                                           sample_id=a.sample_id, version=a.version, sampling=self.store.sampling(rec),
                                           routed_experts=self.algo.wants_routed_experts, turns=turn)
        finally:
            self.turns.close(turn)

    def _may_push(self, instance: str) -> bool:
        """Whether draft pushes to ``instance`` are useful now: it holds at most
        ``rollout.spec_max_batch`` requests (above which the engine does not speculate; 0, which the
        config refuses, would mean always), by the orchestrator's own count of what it placed there."""
        bound = self.rollout.spec_max_batch
        inst = self.orch.instances.get(instance)
        return inst is not None and inst.alive and (bound <= 0 or inst.load <= bound)

    def _out_of_step(self, instance: str, version: int) -> bool:
        """Whether ``instance`` has now refused :data:`OUT_OF_STEP_REFUSALS` requests in a row routed
        for the version the controller last switched it to, with no switch of it under way. A refusal
        racing a switch is normal; refusals of the instance's own version are not: it serves other
        weights than the controller believes (started on another checkpoint, a reload that did not
        take), and re-queueing its samples onto it would go on for ever. Failing it hands it to the
        supervisor's restart, which loads the version the controller expects."""
        inst = self.orch.instances.get(instance)  # the orchestrator's view of what it serves
        if inst is None or inst.version != version or inst.switching:
            self._refusal_streak.pop(instance, None)
            return False
        self._refusal_streak[instance] = self._refusal_streak.get(instance, 0) + 1
        return self._refusal_streak[instance] >= OUT_OF_STEP_REFUSALS

    def absorb(self, ev: EngineReply) -> int | None:
        """Loop (:class:`EngineReply`): apply an engine response. Finished: the sample's length (the
        orchestrator hears of it); aborted: the partial output is kept, None. A late answer about a
        sample whose group was consumed meanwhile (the source's reply to a KV export) is dropped."""
        rec, resp, instance, start, end = self.store.samples.get(ev.sample_id), ev.resp, ev.instance, ev.start, ev.end
        if isinstance(resp, int):  # (the simulator's reply: its length; the runtime's engines answer in full)
            raise TypeError(f"EngineReply of {ev.sample_id}: resp is {resp!r}, not an engine's answer")
        if self.workflow is None:  # a trajectory's turns count their own slot time (:class:`TurnGate`), not its tools'
            self.metrics.request_held_slot(start, end)
        if rec is None:
            return None
        if resp.migrated:
            return None  # the import on the destination delivers this sample
        if self.timeline is not None:
            self.timeline.span(instance, rec.sample_id, start, end, version=rec.version, kind="request")
        reason = self.store.apply(rec, resp)
        if reason == "abort":
            return None  # interrupted (partial mode) or failed over: a later Submit(resume) continues it
        if self.algo.wants_routed_experts:  # covers prompt + every output token (the last submission's input is all of it)
            try:
                meta = resp.raw.get("meta_info")
                self.store.keep_routed(rec, compact_routed(meta.get("routed_experts") if isinstance(meta, Mapping) else None))
            except BatchFileError as err:  # a malformed answer: the sample is kept, without routing
                log.error("%s: sample %s: meta_info.%s", instance, rec.sample_id, err)
                self.store.keep_routed(rec, None)
            if rec.routed_experts is None and instance not in self.routed_experts_off:
                # an optional probe that cannot run there (SGLang without --enable-return-routed-experts
                # answers without them): the instance is not failed for it, one warning, counted
                self.routed_experts_off.add(instance)
                log.warning("%s answers without routed_experts (launched without "
                            "--enable-return-routed-experts?); its samples carry none (counted as "
                            "routed_experts_unavailable)", instance)
        if self.rollout.draft_siblings:
            # offered first: a push this finish holds (its instance not yet counted down) is then
            # among what ``finished`` looks at again once the turn is over
            self.drafts.offer(running_targets(rec, self.store.siblings(rec)), [*rec.prompt_ids, *rec.response_ids])
            self.drafts.finished(instance, rec.sample_id)
        self.store.score(rec, resp, reason, ev.reward)
        if isinstance(resp, WorkflowReply) and resp.loss_mask is not None:  # a workflow's trajectory (rollout.workflow)
            self.metrics.trajectory_finished(TrajectoryStats.of(resp.turns, sum(rec.loss_mask or ()), resp.metrics))
        if self.journal is not None and self.workflow is None:
            # a workflow's trajectory is not journaled (the journal keeps no prompt of its own nor loss
            # mask): after a crash it runs again from its prompt, on its own version
            self.journal.sample(self.replay.journaled(rec), sorted(rec.versions))
        return len(rec.response_ids)

    def sample_versions(self, sample_id: str) -> set[int]:
        """Loop: every version the sample was submitted on or an engine said produced its tokens;
        the orchestrator counts a sample of more than one as a C1 violation (the one C1 count)."""
        return self.store.samples[sample_id].versions
