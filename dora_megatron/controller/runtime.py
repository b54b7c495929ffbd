"""The asyncio executor that carries out the orchestrator's actions with real engines and a real trainer.

Why one loop around one sans-IO object: every decision (what to dispatch where,
which instance switches, which requests migrate, which groups form a batch) is
made by :class:`~dora_megatron.orchestrator.Orchestrator`; this module only turns
its actions into HTTP calls (asyncio tasks) and puts what happened on the event
queue of :class:`~dora_megatron.controller.loop.ControllerLoop` (built and run with the
event sources by :func:`~dora_megatron.controller.main.drive`), which alone feeds
the orchestrator (read :mod:`dora_megatron.controller.loop` first). All of it runs on
the event-loop thread, so the state machine needs no locks.

::

    prompts -> Dispatch ----------> records (prompt ids, seeds)
               Submit   ----------> engine /generate (tagged with its version)   --+
               Migrate  ----------> src /dora/export_request -> dst /dora/import  |  finished
               Interrupt ---------> engine /abort_request (partial output kept)   |  samples
               SwitchVersion -----> engine /update_weights_from_disk (snapshot)   |
               ReleaseBatch ------> trainer /train -> new version snapshot ---+   |
                                                                              |   v
                       on_step_finished(v) <-----------------------------------+  reward,
                       on_sample_finished(id) <------------------------------------+  records

Per-sample ordering: each sample has at most one HTTP operation in flight; a new
operation on a sample (a resubmission after an interrupt, a migration) first
awaits the previous one, so partial outputs are never lost or applied twice. An
instance switch first awaits every move away from it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dora_megatron.controller.checkpointing import CheckpointWriter
from dora_megatron.controller.errors import LOCAL_RETRY_S, is_comm_error as _is_comm_error, is_local as _is_local
from dora_megatron.controller.loop import (EngineReply, EventQueue, InstanceFailed,
                                           InstanceJoined, MigrationFailed, Replayed,
                                           Resume, Start, Stop, SwitchDone, TrainerDone)
from dora_megatron.controller.records import (Engine, GroupRecord, LoadReports, RuntimeOptions, SampleRecord,
                                              StepLog, Trainer)
from dora_megatron.controller.samples import ReleasedBatch, SampleStore
from dora_megatron.data.codec import CharCodec, TextCodec
from dora_megatron.data.tasks import PromptSource
from dora_megatron.orchestrator import (Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion, perform)
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.rollout_dump import RolloutDumper
from dora_megatron.observability.summary import RunTotals
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.workflow.runner import WorkflowFailed
from dora_megatron.controller.siblings import finished_sources, push_source, running_targets
from dora_megatron.controller.migration import Migrations
from dora_megatron.controller.replay import JournalReplay
from dora_megatron.controller.stats import StatsPoller
from dora_megatron.controller.turns import Turns
from dora_megatron.controller.weight_sync import WeightSync
from dora_megatron.rollout.speculation import speculation_summary

log = logging.getLogger(__name__)

#: refusals in a row of requests routed for an instance's own version (no switch under way) after
#: which the instance is failed as out of step with the controller (:meth:`Runtime._out_of_step`)
OUT_OF_STEP_REFUSALS = 3


class Runtime:
    """Runs ``options.steps`` training steps; returns the run summary (DESIGN section 11).

    The executor of the :class:`~dora_megatron.controller.loop.ControllerLoop` that
    :func:`~dora_megatron.controller.main.drive` runs: it implements
    :class:`~dora_megatron.orchestrator.ActionHandler` (one method per action, each starting
    asyncio tasks) and the per-event bookkeeping the loop asks of it. Jobs of their own are its
    components: :attr:`weights` (:mod:`.weight_sync`), :attr:`moves` (:mod:`.migration`),
    :attr:`stats` (:mod:`.stats`), :attr:`checkpoints` (:mod:`.checkpointing`) and :attr:`replay`
    (:mod:`.replay`); it keeps the samples, the trainer step and the checkpoint state."""

    def __init__(self, orch: Orchestrator, engines: dict[str, Engine], trainer: Trainer, source: PromptSource,
                 reward_fn: Callable[[str, str], float], options: RuntimeOptions, *, timeline=None,
                 on_step: Callable[[StepLog, "Runtime"], None] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None, first_prompt: int = 0,
                 codec: TextCodec | None = None, journal=None, metrics: MetricsRecorder | None = None,
                 load_reports: LoadReports | None = None, rollout_dump: RolloutDumper | None = None,
                 events: EventQueue) -> None:
        """``events``: the queue of the :class:`~dora_megatron.controller.loop.ControllerLoop` that
        drives this executor (made by whoever builds the controller): every task reports there.
        ``load_reports``: pushed load reports of the engines it covers, taken once per stats
        sweep instead of polling them (e.g. :class:`~dora_megatron.rollout.sharded.ClientPool`).
        ``rollout_dump``: writes some of each step's samples as the trainer is handed them
        (``observability.dump_rollouts``)."""
        self.rollout_dump = rollout_dump
        #: the eval set's rounds (:class:`~dora_megatron.controller.evaluation.Evaluator`, ``data.eval_path``)
        self.evaluator = None
        #: ``rollout.workflow`` (:class:`~dora_megatron.workflow.runner.WorkflowRunner`); None: one
        #: ``/generate`` per submission (the default single turn)
        self.workflow = None
        self.orch = orch
        self.engines = engines
        self.trainer = trainer
        self.opt = options
        self.timeline = timeline
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint  # at each checkpoint's cut (the launcher's snapshot retention)
        self.codec: TextCodec = codec or CharCodec()
        #: the outstanding groups' prompts, tokens and rewards, and the batch hand-off (:mod:`.samples`)
        self.store = SampleStore(source, self.codec, reward_fn, options, first_prompt)
        self.journal = journal  # :class:`~dora_megatron.controller.journal.Journal` or None
        #: every metric of the run (summary.json, steps.jsonl, TensorBoard) comes from these events
        self.metrics = metrics or MetricsRecorder(slots_per_instance=options.slots_per_instance,
                                                  rebalancer=orch.policy.rebalance)
        #: the step logs of this process only (the run's are steps.jsonl's rows; a checkpoint keeps
        #: their count, not them, so its size does not grow with the step count)
        self.steps: list[StepLog] = []
        self.steps_done = 0  # steps of the run so far, resumed ones included
        self.failed_ever: set[str] = set()  # every instance that failed at least once (rejoined ones too)
        self.rejoins = 0  # failed instances that came back (``add_instance`` of a failed name)
        self.samples_after_rejoin = 0  # samples finished on an instance after it rejoined
        self._rejoined: set[str] = set()
        #: engine processes restarted by a supervising launcher (None: no supervisor, e.g. SLURM)
        self.engine_restarts: int | None = None
        #: set by a supervisor that restarts failed instances: losing all of them is not fatal then
        #: (the supervisor ends the run when no restart is left)
        self.instances_may_return = False
        #: instances not ready when the job started (name -> why): out of the pool until they join
        self.absent_at_start: dict[str, str] = {}
        self._late_starters: set[str] = set()  # of those, the ones that never failed (only slow to load)
        #: instances whose answers carry no routed_experts although asked for (same rule)
        self.routed_experts_off: set[str] = set()
        #: calls that failed for a shortage of the controller's own process (EMFILE, ENOBUFS, a
        #: full pool): retried or re-queued, never counted against the instance
        self.local_resource_errors = 0
        #: this process's back-pressure count (calls that waited for a pooled connection), set by
        #: the launcher that sized the pools (:class:`~dora_megatron.comm.limits.ConnectionWaits`)
        self.connection_waits = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self.events = events
        #: the event source of load reports and ticks (:mod:`.stats`)
        self.stats = StatsPoller(orch, engines, self.events, options, self.local_shortage, load_reports)
        #: switches, their checks and the ``distributed`` push (:mod:`.weight_sync`)
        self.weights = WeightSync(self)
        #: migrations and interrupts of in-flight requests (:mod:`.migration`)
        self.moves = Migrations(self)
        #: a workflow's trajectories between their turns (:mod:`.turns`)
        self.turns = Turns(self)
        #: the checkpoint files: the trainer's part, then controller.json (:mod:`.checkpointing`)
        self.checkpoints = CheckpointWriter(self)
        #: finished samples the journal recorded after the checkpoint resumed from (:mod:`.replay`)
        self.replay = JournalReplay(self)
        self._t0 = 0.0
        self._trainer_idle_since = 0.0
        self._wall_offset = 0.0
        self._resumed = False
        self._pending_step_finished: int | None = None
        self.version_refusals = 0
        self._refusal_streak: dict[str, int] = {}  # instance -> refusals in a row of its own version
        #: a stop asked from outside (the launcher's first SIGINT/SIGTERM/SIGUSR1): its reason, and the
        #: version of the checkpoint written for it (None: none yet, or the step was abandoned)
        self.stop_reason: str | None = None
        self.stop_checkpoint: int | None = None
        self._stop_at_boundary = False

    @property
    def samples(self) -> dict[str, SampleRecord]:
        """The outstanding samples' records (:attr:`SampleStore.samples`)."""
        return self.store.samples

    @property
    def groups(self) -> dict[str, GroupRecord]:
        """The outstanding groups' records (:attr:`SampleStore.groups`)."""
        return self.store.groups

    @property
    def samples_finished(self) -> int:
        return self.store.samples_finished

    @property
    def load_reports(self) -> LoadReports | None:
        """The stats poller's pushed load reports (:attr:`StatsPoller.load_reports`)."""
        return self.stats.load_reports

    @load_reports.setter
    def load_reports(self, reports: LoadReports | None) -> None:
        self.stats.load_reports = reports

    @property
    def latest_version(self) -> int:
        """The newest weights the trainer holds (:attr:`WeightSync.latest_version`)."""
        return self.weights.latest_version

    @latest_version.setter
    def latest_version(self, version: int) -> None:
        self.weights.latest_version = version

    @property
    def migrations_fallback(self) -> int:
        return self.moves.migrations_fallback

    @property
    def weight_sync_timeouts(self) -> int:
        return self.weights.weight_sync_timeouts

    @property
    def instance_checksums(self) -> dict[int, str]:
        return self.weights.instance_checksums

    @property
    def checksum_off(self) -> set[str]:
        return self.weights.checksum_off

    # ------------------------------------------------------------------ helpers
    def is_failed(self, instance: str) -> bool:
        """Whether ``instance`` is failed (one the orchestrator does not know is): the orchestrator's
        view (it owns run state), not a copy. O(1): what a launcher's poller asks per instance."""
        return not self.orch.is_alive(instance)

    def all_failed(self) -> bool:
        """Whether the pool has instances and none is alive. O(1) while the orchestrator counts none
        alive, else it stops at the first alive instance: pollers ask it every poll, at 4,096 instances."""
        if not self.engines:
            return False
        return self.orch.alive_count() == 0 or not any(self.orch.is_alive(iid) for iid in self.engines)

    def instance_version(self, instance: str) -> int | None:
        """The weights ``instance`` serves, as the orchestrator knows them (None: unknown to it, or
        joined and not switched yet); the executor keeps no copy."""
        inst = self.orch.instances.get(instance)
        return None if inst is None else inst.version

    @property
    def failed(self) -> set[str]:
        """The pool's failed instances, O(pool): for tests, which compare the whole set; pollers ask
        :meth:`is_failed` / :meth:`all_failed` instead."""
        return {iid for iid in self.engines if self.is_failed(iid)}

    def now(self) -> float:
        return time.monotonic() - self._t0 + self._wall_offset

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._guard(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - any failure stops the run with its cause
            log.exception("runtime task failed")
            self.stop(err)

    def execute(self, actions: list) -> None:
        """Carry out one orchestrator answer (called by the loop only). Switches to the weights the
        trainer still holds (``distributed`` transport) are collected over the whole list and done
        with one broadcast."""
        perform(self, actions)
        self.weights.flush()

    # ------------------------------------------------------------------ ActionHandler
    def submit(self, a: Submit) -> None:
        if self.turns.hand_over(a):  # the next turn of a trajectory in flight
            return
        self._chain(a.sample_id, self._submit(a), f"submit-{a.sample_id}")

    def migrate(self, a: Migrate) -> None:
        self.moves.migrate(a)

    def interrupt(self, a: Interrupt) -> None:
        self.moves.interrupt(a)

    def pending_moves(self, instance: str) -> list[asyncio.Future]:
        """:meth:`Migrations.pending`: what a switch of ``instance`` waits for."""
        return self.moves.pending(instance)

    def switch_version(self, a: SwitchVersion) -> None:
        self.weights.order(a)

    def switch_landed(self, ev: SwitchDone, origin: asyncio.Task | None) -> bool:
        """Loop (:class:`SwitchDone`): :meth:`WeightSync.landed`."""
        return self.weights.landed(ev, origin)

    def _chain(self, sample_id: str, coro, name: str) -> asyncio.Task:
        """Run ``coro`` after the sample's previous operation finished (per-sample ordering)."""
        rec = self.samples[sample_id]
        prev = rec.task

        async def run():
            if prev is not None and not prev.done():
                await asyncio.wait([prev])
            await coro

        rec.task = self.spawn(run(), name)
        return rec.task

    def concurrent(self, sample_id: str, make_coro, name: str) -> asyncio.Task:
        """Run an operation that acts on the sample's in-flight request (it does not wait for it);
        later operations on the sample wait for both."""
        rec = self.samples[sample_id]
        prev = rec.task
        task = self.spawn(make_coro(prev), name)

        async def both():
            await asyncio.wait([t for t in (prev, task) if t is not None])

        rec.task = self.spawn(both(), f"{name}-join")
        return task

    def dispatch(self, a: Dispatch) -> None:
        group = self.store.dispatch(a)
        if self.journal is not None:
            self.journal.dispatch(a.group_id, a.version, group.prompt.index, list(a.sample_ids))
        self.replay.restore(a.group_id)

    def prompt_tokens(self, group_id: str) -> int:
        """Loop: the prompt length of a dispatched group (the orchestrator's re-prefill accounting)."""
        return self.store.prompt_tokens(group_id)

    # ------------------------------------------------------------------ journal (resume)
    def load_journal(self, samples: dict[str, Any]) -> None:
        """After :meth:`load_state_dict`: :meth:`JournalReplay.load`."""
        self.replay.load(samples)

    def replayed(self, sample_id: str) -> int | None:
        """Loop (:class:`Replayed`): :meth:`JournalReplay.replayed`."""
        return self.replay.replayed(sample_id)

    @property
    def samples_from_journal(self) -> int:
        return self.replay.samples_from_journal

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

        rec = self.samples.get(a.sample_id)
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
        delay, deadline = LOCAL_RETRY_S[0], time.monotonic() + self.opt.request_timeout_s
        while True:
            start = self.now()
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
                    if not self.is_current(a.instance, engine):
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
        end = self.now()
        reward = await self.store.reward_off_loop(rec, resp)  # off the loop thread, before the report
        await self.events.report(EngineReply(a.sample_id, a.instance, resp, start, end, reward))

    def _last_turn(self, rec: SampleRecord, a: Submit, engine: Engine) -> tuple[Submit, Engine]:
        """``a`` naming the instance (and the engine) of the last turn of the sample's trajectory,
        where its answer or its failure came from (without a workflow: ``a``'s own)."""
        at, engine = self.turns.where(rec, a.instance, engine)
        return (a if at == a.instance else replace(a, instance=at)), engine

    async def _generate(self, engine: Engine, rec: SampleRecord, a: Submit):
        """One submission's answer: the engine's, or with ``rollout.workflow`` the whole trajectory
        its workflow generated on this instance with this version (every turn pinned to it)."""
        if self.workflow is None:
            return await engine.generate(rec.prompt_ids + rec.output_ids, self.store.sampling(rec), rid=a.sample_id,
                                         return_logprob=True, version=a.version,
                                         **({"routed_experts": True} if self.opt.routed_experts else {}),
                                         **({"draft_sources": finished_sources(rec, self.store.siblings(rec))}
                                            if self.opt.draft_siblings else {}))
        turn = self.turns.open(rec, a.instance, engine)
        try:
            return await self.workflow.run(engine, self.groups[rec.group_id].prompt, rec.prompt_ids,
                                           sample_id=a.sample_id, version=a.version, sampling=self.store.sampling(rec),
                                           routed_experts=self.opt.routed_experts, turns=turn)
        finally:
            self.turns.close(turn)

    def turn_current(self, sample_id: str, turn: Any) -> bool:
        """Loop (:class:`TurnEnded`, :class:`TurnReady`): :meth:`Turns.current`."""
        return self.turns.current(sample_id, turn)

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
        rec, resp, instance, start, end = self.samples.get(ev.sample_id), ev.resp, ev.instance, ev.start, ev.end
        if self.workflow is None:  # a trajectory's turns count their own slot time (:class:`TurnGate`), not its tools'
            self.metrics.request_held_slot(start, end)
        if rec is None:
            return None
        if getattr(resp, "migrated", False):
            return None  # the import on the destination delivers this sample
        if self.timeline is not None:
            self.timeline.span(instance, rec.sample_id, start, end, version=rec.version, kind="request")
        reason = self.store.apply(rec, resp)
        if reason == "abort":
            return None  # interrupted (partial mode) or failed over: a later Submit(resume) continues it
        if self.opt.routed_experts:  # covers prompt + every output token (the last submission's input is all of it)
            rec.routed_experts = (resp.raw.get("meta_info") or {}).get("routed_experts")
            if rec.routed_experts is None and instance not in self.routed_experts_off:
                # an optional probe that cannot run there (SGLang without --enable-return-routed-experts
                # answers without them): the instance is not failed for it, one warning, counted
                self.routed_experts_off.add(instance)
                log.warning("%s answers without routed_experts (launched without "
                            "--enable-return-routed-experts?); its samples carry none (counted as "
                            "routed_experts_unavailable)", instance)
        if self.opt.draft_siblings:
            targets = running_targets(rec, self.store.siblings(rec))
            self.spawn(push_source(self.engines, targets, rec.prompt_ids + rec.output_ids), f"drafts-{rec.sample_id}")
        if instance in self._rejoined:
            self.samples_after_rejoin += 1
        self.store.score(rec, resp, reason, ev.reward)
        if getattr(resp, "loss_mask", None) is not None:  # a workflow's trajectory (rollout.workflow)
            self.metrics.trajectory_finished(TrajectoryStats.of(resp.turns, sum(rec.loss_mask), resp.metrics))
        if self.journal is not None and self.workflow is None:
            # a workflow's trajectory is not journaled (the journal keeps no prompt of its own nor loss
            # mask): after a crash it runs again from its prompt, on its own version
            self.journal.sample(self.replay.journaled(rec), sorted(rec.versions))
        return len(rec.output_ids)

    def sample_versions(self, sample_id: str) -> set[int]:
        """Loop: every version the sample was submitted on or an engine said produced its tokens;
        the orchestrator counts a sample of more than one as a C1 violation (the one C1 count)."""
        return self.samples[sample_id].versions

    def add_instance(self, name: str, engine: Engine) -> None:
        """Elastic pools: ``engine`` joins the running job as ``name`` (new, or a failed name coming
        back); the orchestrator switches it to the version it assigns, then routes work to it.
        Goes through the loop (:class:`InstanceJoined`), after any failure reported before it."""
        self.events.post(InstanceJoined(name, engine))

    def register(self, ev: InstanceJoined) -> bool:
        """Loop (:class:`InstanceJoined`): put the client in the pool; whether the orchestrator is to hear of it."""
        name = ev.instance
        if name in self.engines and not self.is_failed(name):
            log.warning("instance %s is already in the pool; ignoring its second join", name)
            return False
        self.engines[name] = ev.engine
        self._late_starters.discard(name)
        self.metrics.instance_joined(name, self.now())
        if name in self.failed_ever and self.is_failed(name):  # (a new name is unknown to the orchestrator too)
            self.rejoins += 1
            self._rejoined.add(name)
            log.info("instance %s rejoined the pool", name)
        else:
            log.info("instance %s joined the pool", name)
        return True

    def start_without(self, absent: dict[str, str], loading: set[str] = frozenset()) -> None:
        """Call before :meth:`begin`: the run starts without ``absent`` (name -> why they are not ready;
        the launcher adds each once it serves, :meth:`add_instance`). ``loading``: those of them that
        did not fail, only were not ready yet (they are not counted as failed instances)."""
        self.absent_at_start = dict(absent)
        self._late_starters = set(loading) & set(absent)

    def is_current(self, instance: str, engine: Engine) -> bool:
        """Loop: ``engine`` is still ``instance``'s client and the instance has not failed."""
        return not self.is_failed(instance) and self.engines.get(instance) is engine

    def report_failure(self, instance: str, why: str, engine: Engine | None = None) -> None:
        """For launchers (a supervisor saw the process exit, a node restarted it): ``instance``
        failed. Goes through the loop like every other event."""
        self.events.post(InstanceFailed(instance, why, engine))

    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task | None) -> bool:
        """Loop (:class:`InstanceFailed`): whether the orchestrator is to hear of it. ``ev.engine``:
        the client the failing call used; a failure seen through a client that has since been
        replaced (the instance was restarted and rejoined) is stale and ignored. The requests in
        flight there are cancelled (not the one that reported, ``origin``)."""
        instance, why = ev.instance, ev.why
        if self.is_failed(instance) or instance not in self.engines:
            return False
        if ev.engine is not None and self.engines.get(instance) is not ev.engine:
            log.info("ignoring a stale failure of %s (replaced since): %s", instance, why)
            return False
        log.warning("instance %s failed: %s", instance, why)
        self.metrics.instance_left(instance, self.now())
        if instance not in self._late_starters:
            self.failed_ever.add(instance)  # (the orchestrator hears of it next: it owns which instances are failed)
        for rec in self.samples.values():  # stop waiting on requests that lived there
            if rec.gen_instance == instance and rec.gen_task is not None and rec.gen_task is not origin \
                    and not rec.gen_task.done() and not rec.finished:
                rec.gen_task.cancel()
        if all(i == instance or self.is_failed(i) for i in self.engines) and not self.instances_may_return:
            self.stop(RuntimeError("every rollout instance failed"))
        return True

    @property
    def ended(self) -> asyncio.Event:
        """Set once the run ends (:meth:`stop`): a :class:`ControllerLoop` runs until it is."""
        return self._done

    @property
    def tasks(self) -> tuple[asyncio.Task, ...]:
        """The asyncio tasks this executor started that have not ended yet."""
        return tuple(self._tasks)

    def is_done(self) -> bool:
        """Whether the run was ended (:meth:`stop`): a supervisor stops acting on it then."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What ended the run, the first error given to :meth:`stop` (None: none so far)."""
        return self._error

    def stop(self, error: BaseException | None = None) -> None:
        """End the run (with ``error``, the first one wins): the loop stops after its current event."""
        if error is not None and self._error is None:
            self._error = error
        self._done.set()
        self.events.post(Stop())

    def release_batch(self, a: ReleaseBatch) -> None:
        """Hand the batch to the trainer: the groups are consumed now (exactly once), ``/train`` runs
        in a task that reports :class:`TrainerDone`."""
        start = self.now()
        wait = max(0.0, start - self._trainer_idle_since)
        samples, batch, dumped = self.store.take_batch(a, wait, dump=self.rollout_dump is not None)
        if self.rollout_dump is not None:
            self.rollout_dump.dump(a.step, dumped)
        self.spawn(self._train(a.step, samples, start, batch), f"train-{a.step}")

    async def _train(self, step: int, samples: list[dict], start: float, batch: ReleasedBatch) -> None:
        t_train = time.monotonic()
        result = await self.trainer.train(step, samples)
        train_s = time.monotonic() - t_train
        trained = self.now()
        # the trainer's own measures when it reports them: /train includes the snapshot export
        export_s = min(float(result.get("export_s") or 0.0), train_s)
        self.metrics.trainer_sync(trained - export_s, trained)
        train_s = float(result.get("train_s", train_s - export_s))
        await self.events.report(TrainerDone(step, result, start, train_s, batch))

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        """Loop (:class:`TrainerDone`): log the step; returns the new weights' version and whether a
        checkpoint is due (then its trainer part is being written and :class:`CheckpointSaved` follows)."""
        result, b = ev.result, ev.batch
        new_version = int(result["version"])
        self.latest_version = new_version
        if result.get("checksum"):
            self.weights.expected_checksums[new_version] = result["checksum"]
        end = self.now()
        metrics = dict(result.get("metrics", {}))
        if result.get("padding_fraction") is not None:  # a trainer that packs reports it beside its metrics
            metrics["padding_fraction"] = result["padding_fraction"]
        oc = self.orch.counters
        scalars = self.metrics.step_trained(
            ev.step, end_s=end, wait_s=b.wait_s, train_s=ev.train_s, tokens=b.tokens, staleness=b.staleness,
            rewards=b.rewards, response_lengths=b.lengths, live_versions=live_versions, metrics=metrics,
            migrations=oc.migrations, migrated_kv_bytes=self.moves.migrated_bytes, reprefill_tokens=oc.reprefill_tokens)
        log_ = StepLog(ev.step, ev.start, end, b.wait_s, ev.train_s, scalars["perf/sync_time_s"], metrics, b.rewards,
                       b.lengths, b.staleness, b.tokens, live_versions, list(b.group_ids), list(b.versions))
        self.steps.append(log_)
        # the orchestrator numbers steps from 0 (its step counter, restored with it on resume):
        # trained step ``ev.step`` makes ``ev.step + 1`` steps done
        self.steps_done = ev.step + 1
        if self.timeline is not None:
            self.timeline.span("trainer", f"step {ev.step}", ev.start, end, version=ev.step, kind="train",
                               produced=new_version)
        if self.on_step is not None:
            self.on_step(log_, self)
        self._trainer_idle_since = end
        finished = self.steps_done >= self.opt.steps
        last = finished or self.stop_reason is not None  # a stop ends the run here
        if self.evaluator is not None:  # a round of these weights, beside the rollout (or the final one)
            self.evaluator.after_step(self.steps_done, new_version, finished)
        due = self.opt.checkpoint_dir is not None and (
            last or bool(self.opt.checkpoint_interval and new_version % self.opt.checkpoint_interval == 0))
        if due and self.stop_reason is not None:
            self._stop_at_boundary = True  # the step ended in time: its checkpoint is not abandoned
        if due:
            # Trainer first, then the controller state, both at the same boundary: weights
            # ``new_version`` exist and the orchestrator has not yet reacted to them (resume
            # replays ``on_step_finished(new_version)``).
            self.spawn(self.checkpoints.save_trainer(new_version), f"checkpoint-v{new_version}")
        return new_version, due

    def step_boundary(self) -> bool:
        """Loop: after a step (and its checkpoint): True when it was the last one, or a stop was
        asked (the run ends; its checkpoint was written in this turn)."""
        if self.steps_done >= self.opt.steps or self.stop_reason is not None:
            self.stop()
            return True
        return False

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary with a checkpoint there (``reason``: e.g. ``SIGINT``),
        whatever ``checkpoint_interval`` says, so that ``--resume`` loses nothing.

        WHY at a boundary: a checkpoint is a cut where weights ``v`` exist and the orchestrator has
        not reacted to them; mid-step there is no such cut. Bounded: when no step ends within
        ``stop_checkpoint_timeout_s`` the step is abandoned (the run stops without a new
        checkpoint; the last complete one stays, ``--resume`` redoes what came after it). Only the
        first request counts (a second signal is the launcher's: it exits at once)."""
        if self.stop_reason is not None or self._done.is_set():
            return
        self.stop_reason = reason
        timeout = self.opt.stop_checkpoint_timeout_s
        log.warning("stop asked (%s): checkpoint at the end of the current step (at most %.0f s, "
                    "controller.stop_checkpoint_timeout_s), then exit", reason, timeout)
        self.spawn(self._abandon_after(timeout), "stop-timeout")

    async def _abandon_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if not self._stop_at_boundary and not self._done.is_set():
            log.warning("stop (%s): no step boundary within %.0f s (controller.stop_checkpoint_timeout_s): the "
                        "step is abandoned; the last complete checkpoint stays", self.stop_reason, timeout_s)
            self.stop()

    # ------------------------------------------------------------------ checkpoints
    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        """Loop (:class:`CheckpointSaved`): the controller part, taken before ``on_step_finished``
        so the orchestrator is at a step boundary.

        The state is cut in this loop turn (with the journal's marker, which splits exactly
        there); its encoding and files are written by a task a chunk per loop turn
        (:mod:`.state_file`: at thousands of instances one ``json.dumps`` of it held the loop for
        up to a second), chained after any earlier one. The run's last checkpoint is written at
        once (the run ends right after and stops its tasks), finishing an earlier one first.
        ``controller.json`` is written last and atomically: a checkpoint directory without it is
        incomplete and ignored by resume, which then falls back one checkpoint (the journal keeps
        the records since the one before, :mod:`.journal`). Just before it, ``manifest.json``
        (sizes and SHA-256 of the trainer's files and of ``controller.json``) lets resume detect a
        corrupt checkpoint."""
        path = Path(self.opt.checkpoint_dir(version))
        state = self.state_dict(version, orchestrator_snapshot)

        def complete() -> None:
            log.info("checkpoint v%d written to %s", version, path)
            if self.journal is not None:
                self.journal.completed(version)

        writer = self.checkpoints.start_state(version, state, complete)
        if self.journal is not None:
            self.journal.checkpoint(version)
        if self.on_checkpoint is not None:
            # in the turn of the cut too: the launcher's snapshot retention records the live
            # versions the checkpoint holds (later they have moved on, and a snapshot it needs
            # would be pruned); it keeps the previous checkpoint's as well, the fallback while
            # this one is being written
            self.on_checkpoint(version)
        if self.stop_reason is not None:
            self.stop_checkpoint = version  # written at once below: the run ends in this turn
        self.checkpoints.finish(version, writer,
                                at_once=self.steps_done >= self.opt.steps or self.stop_reason is not None)

    def state_dict(self, version: int, orchestrator_snapshot: dict[str, Any]) -> dict[str, Any]:
        """The controller part of a checkpoint, sized by outstanding work (DESIGN section 5.5): the
        outstanding groups' prompts, the finished samples' outputs, counters, the number of steps done.

        WHY nothing per step: the step logs and the metrics recorder's per-step rows are
        ``steps.jsonl``'s (:meth:`load_state_dict` takes them back from it), and the orchestrator
        snapshot already lists every outstanding group and sample with its version and ids; what is
        kept here is only what it does not hold (prompt and output tokens, rewards). Unfinished
        samples restart from their prompt on their own version (C1), so they need no entry."""
        groups, samples = self.store.state_entries()
        # the checksums an instance may still load after a resume: the versions of outstanding work
        # and the newest (older ones are never switched to again)
        oldest = min((int(g["version"]) for g in orchestrator_snapshot["groups"]), default=version)
        return {
            "format": 2, "version": version, "pending_step_finished": version,
            "next_prompt": self.store.next_prompt, "wall_s": self.now(),
            "orchestrator": orchestrator_snapshot,
            "groups": groups, "samples": samples,
            "steps_done": self.steps_done,
            "metrics": self.metrics.state_dict(), "migrated_bytes": self.moves.migrated_bytes,
            "migrations_done": self.moves.migrations_done, "migrations_fallback": self.moves.migrations_fallback,
            "migration_stall_s": self.moves.stall_s, "migration_freed_slot_s": self.moves.freed_slot_s,
            "expected_checksums": {str(k): v for k, v in self.weights.expected_checksums.items() if k >= min(oldest, version)},
        }

    def load_state_dict(self, state: dict[str, Any], step_rows: Sequence[dict[str, Any]] = ()) -> None:
        """Continue from :meth:`state_dict`: unfinished samples of unconsumed groups are re-run on
        their own version; every instance is fresh and is switched to the version it is given.
        ``step_rows``: the metrics recorder's rows of the steps done, as ``steps.jsonl`` has them
        (:func:`~dora_megatron.observability.recorder.read_step_rows`; the summary of the resumed
        run covers the whole run)."""
        self.store.load_entries(state)
        self._wall_offset = float(state["wall_s"])
        # consumed groups are not carried (consumed.jsonl lists them; an older controller.json's
        # "consumed" is ignored): the restored orchestrator has forgotten them, so none can be
        # released again
        # the step logs themselves are steps.jsonl's (an older controller.json's "steps" list: its length)
        self.steps_done = int(state["steps_done"]) if "steps_done" in state else len(state["steps"])
        if "metrics" in state:  # absent in checkpoints written before the recorder: the summary then starts anew
            self.metrics.load_state_dict(state["metrics"], rows=step_rows)
        self.moves.migrated_bytes = int(state["migrated_bytes"])
        self.moves.migrations_done = int(state["migrations_done"])
        self.moves.migrations_fallback = int(state["migrations_fallback"])
        # absent in checkpoints written before these were measured: the resumed run counts from 0
        self.moves.stall_s = float(state.get("migration_stall_s", 0.0))
        self.moves.freed_slot_s = float(state.get("migration_freed_slot_s", 0.0))
        self.weights.expected_checksums = {int(k): v for k, v in state["expected_checksums"].items()}
        self._pending_step_finished = state.get("pending_step_finished")
        self.latest_version = int(state["version"])
        # an older controller.json also holds "c1_count"/"duplicated": ignored, the C1 and
        # duplicate counts of a run are the orchestrator's (its snapshot carries them)
        self._resumed = True

    # ------------------------------------------------------------------ start and end of the run
    def begin(self) -> None:
        """What comes before the loop reads its first event (:func:`~dora_megatron.controller.main.drive`):
        the clock starts, the instances absent at start fail, ``Start`` or ``Resume`` is posted (a
        resumed run whose every step was done ends at once)."""
        self._t0 = time.monotonic()
        self._trainer_idle_since = self._wall_offset
        for iid in self.engines:
            self.metrics.instance_joined(iid, self.now())
        for iid, why in self.absent_at_start.items():  # before Start / Resume: never given work
            self.events.post(InstanceFailed(iid, f"not ready when the job started: {why}"))
        if self.timeline is not None:
            start = self.now()  # a resumed run starts at the checkpoint's wall time, not at 0
            if self._resumed and start > 0:
                self.timeline.span("trainer", "before the resume (previous run)", 0.0, start, kind="resumed")
            for iid in self.engines:
                v = self.instance_version(iid)
                if v is not None:
                    self.timeline.set_version(iid, v, start)
        if self._resumed and self.steps_done >= self.opt.steps:
            # every step was done before the checkpoint: nothing to dispatch, and no
            # on_step_finished will ever come to end the run
            self._done.set()
        elif self._resumed:
            self._trainer_idle_since = self.now()
            pending = self._pending_step_finished if self.steps_done < self.opt.steps else None
            self.events.post(Resume(tuple(i for i in self.engines if i not in self.absent_at_start), pending))
        else:
            self.events.post(Start())

    async def finish(self, loop_error: BaseException | None = None) -> dict[str, Any]:
        """After the loop ended: stop what still runs; raise the run's error (``loop_error``, the
        loop's own failure, counts as one given to :meth:`stop`: the first wins) or evaluate the
        final weights and return the summary."""
        if loop_error is not None and self._error is None:
            self._error = loop_error
        if self._error is not None:
            if self.evaluator is not None:
                self.evaluator.cancel()
            await self._cancel_all()
            raise self._error
        wall = self.now()
        await self._cancel_all()
        if self.timeline is not None:
            self.timeline.close(wall)
        if self.evaluator is not None and self.stop_reason is None:  # the final weights, once the rollout stopped (not in the run's wall time; not on a stop)
            await self.evaluator.finish(self.steps_done, self.latest_version or max(
                (v for v in map(self.instance_version, self.engines) if v is not None), default=0))
        return self.summary(wall)

    async def _cancel_all(self) -> None:
        """Abort what is still generating (outstanding groups of the next steps) and stop tasks.
        Every instance at once: one after the other, 4,096 instances took minutes to stop."""
        async def abort_all(engine: Engine) -> None:
            try:
                await asyncio.wait_for(engine.abort(abort_all=True), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

        await asyncio.gather(*(abort_all(e) for iid, e in list(self.engines.items()) if not self.is_failed(iid)))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ summary
    def summary(self, wall: float) -> dict[str, Any]:
        """The recorder's metrics, then facts of this run only the runtime knows (instances, checksums)."""
        osum = self.orch.summary()
        totals = RunTotals(
            dispatched_groups=osum["dispatched_groups"], consumed_groups=osum["consumed_groups"],
            lost_groups=osum["lost_groups"], duplicated_groups=osum["duplicated_groups"],
            c1_violations=osum["c1_violations"], c3_violations=osum["c3_violations"],
            migrations=osum["migrations"], migrated_kv_bytes=self.moves.migrated_bytes,
            reprefill_tokens=osum["reprefill_tokens"])
        out = self.metrics.summary(mode=osum["mode"], max_staleness=osum["max_staleness"], tbs=osum["tbs"],
                                   rbs=osum["rbs"], totals=totals, wall_time_s=wall)
        out["migrations_kv"] = self.moves.migrations_done
        out["migrations_reprefill"] = self.moves.migrations_fallback
        out["migration_stall_s"] = self.moves.stall_s
        out["migration_freed_slot_s"] = self.moves.freed_slot_s
        out["checksum_mismatches"] = self.weights.checksum_mismatches
        out["checksum_unavailable"] = len(self.weights.checksum_off)
        out["routed_experts_unavailable"] = len(self.routed_experts_off)
        out["speculation"] = speculation_summary([self.stats.spec_totals])
        out["version_refusals"] = self.version_refusals
        out["weight_push_bytes"] = self.weights.pushed_bytes
        out["instances"] = sorted(self.engines)  # every instance that was in the pool (joined ones too)
        out["failed_instances"] = sorted(self.failed_ever)
        out["instances_rejoined"] = self.rejoins
        out["samples_after_rejoin"] = self.samples_after_rejoin
        out["engine_restarts"] = self.engine_restarts
        out["instances_absent_at_start"] = dict(sorted(self.absent_at_start.items()))
        out["weight_sync_timeouts"] = self.weights.weight_sync_timeouts
        out["local_resource_errors"] = self.local_resource_errors
        waits = self.connection_waits
        out["connection_waits"] = waits() if callable(waits) else (waits.count if waits is not None else 0)
        out["samples_from_journal"] = self.samples_from_journal
        out["max_live_versions"] = osum.get("max_live_versions")
        out["outstanding_groups_at_end"] = osum["dispatched_groups"] - osum["consumed_groups"]
        if self.evaluator is not None:
            out.update(self.evaluator.summary())
        if self.workflow is not None:
            out.update(self.workflow.counts)
            out["workflow_turn_moves"] = osum["workflow_turn_moves"]
            out.update(self.turns.summary())  # the moves' prefix KV: carried or computed again
        # "completed"; "stopped" (a stop request: checkpoint ``stop_checkpoint`` written, ``--resume``
        # goes on from it); "stopped_without_checkpoint" (the step was abandoned: the last complete
        # checkpoint stays)
        out["status"] = ("completed" if self.stop_reason is None or self.steps_done >= self.opt.steps else
                         "stopped" if self.stop_checkpoint is not None else "stopped_without_checkpoint")
        out["stopped_by"] = self.stop_reason
        out["stop_checkpoint"] = self.stop_checkpoint
        return out
