"""The executor: it maps the orchestrator's actions and the loop's events onto the controller's
components, and owns the run's tasks, clock and end.

Why one loop around one sans-IO object: every decision (what to dispatch where,
which instance switches, which requests migrate, which groups form a batch) is
made by :class:`~dora_megatron.orchestrator.Orchestrator`; the components turn
its actions into HTTP calls (asyncio tasks) and put what happened on the event
queue of :class:`~dora_megatron.controller.loop.ControllerLoop` (built and run with the
event sources by :func:`~dora_megatron.controller.main.drive`), which alone feeds
the orchestrator (read :mod:`dora_megatron.controller.loop` first). All of it runs on
the event-loop thread, so the state machine needs no locks.

::

    prompts -> Dispatch ----------> generation: records (prompt ids, seeds)
               Submit   ----------> generation: engine /generate (its version)   --+
               Migrate  ----------> moves: src export_request -> dst import        |  finished
               Interrupt ---------> moves: engine /abort_request (partial kept)    |  samples
               SwitchVersion -----> weights: /update_weights_from_disk (snapshot)  |
               ReleaseBatch ------> training: trainer /train -> new snapshot --+    |
                                                                               |    v
                       on_step_finished(v) <------------------------------------+  reward,
                       on_sample_finished(id) <-------------------------------------+  records

Per-sample ordering: each sample has at most one HTTP operation in flight; a new
operation on a sample (a resubmission after an interrupt, a migration) first
awaits the previous one, so partial outputs are never lost or applied twice. An
instance switch first awaits every move away from it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.checkpointing import CheckpointWriter
from dora_megatron.controller.controller_state import ControllerState
from dora_megatron.controller.generation import Generation
from dora_megatron.events import EngineReply, InstanceFailed, InstanceJoined, Resume, Start, SwitchDone, TrainerDone
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.loop_lag import LoopLag
from dora_megatron.controller.migration import Migrations
from dora_megatron.controller.pool import Pool
from dora_megatron.controller.records import Engine, LoadReports, RunPaths, Trainer, instance_slots
from dora_megatron.controller.replay import JournalReplay
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.controller.samples import RewardFn, SampleStore
from dora_megatron.controller.shutdown import collector_paused
from dora_megatron.controller.stats import StatsPoller
from dora_megatron.controller.summary import run_summary
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.controller.training import Training
from dora_megatron.controller.turns import Turns
from dora_megatron.controller.weight_sync import WeightSync
from dora_megatron.data.codec import CharCodec, TextCodec
from dora_megatron.data.tasks import PromptSource
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.summary import StepRecord
from dora_megatron.orchestrator import (Action, Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion, perform)

if TYPE_CHECKING:
    from dora_megatron.controller.evaluation import Evaluator
    from dora_megatron.controller.journal import Journal
    from dora_megatron.observability.rollout_dump import RolloutDumper
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.workflow.runner import WorkflowRunner

log = logging.getLogger(__name__)

class Runtime:
    """Runs ``run.steps`` training steps; returns the run summary (DESIGN section 11).

    The executor of the :class:`~dora_megatron.controller.loop.ControllerLoop` that
    :func:`~dora_megatron.controller.main.drive` runs: each action
    (:class:`~dora_megatron.orchestrator.ActionHandler`) and each event's bookkeeping
    (:class:`~dora_megatron.events.Executor`) goes to the one component whose job it is:
    :attr:`generation` (:mod:`.generation`), :attr:`moves` (:mod:`.migration`), :attr:`weights`
    (:mod:`.weight_sync`), :attr:`training` (:mod:`.training`), :attr:`pool` (:mod:`.pool`),
    :attr:`controller_state` (:mod:`.controller_state`) with :attr:`checkpoints`
    (:mod:`.checkpointing`), :attr:`replay` (:mod:`.replay`), :attr:`turns` (:mod:`.turns`),
    :attr:`stats` (:mod:`.stats`), over the samples of :attr:`store` (:mod:`.samples`); the run's
    tasks, clock and end are :attr:`tasks` (:class:`~dora_megatron.controller.run_tasks.RunTasks`).
    Components never import each other at run time, nor reach each other through this executor:
    each is handed, when it is built, the typed collaborators it uses (e.g. the moves'
    ``generation``, a switch's ``moves``), in an order that needs no cycle; the eval rounds, built
    after it by whoever builds the controller, come through :meth:`attach_evaluator`. Each
    component is handed the config sections it reads, the loaded config's own objects (no copy of
    their values is kept here). Launchers ask the component that owns the answer (``pool``,
    ``training``, ``tasks``); only what becomes an event (:meth:`add_instance`,
    :meth:`report_failure`) is asked of this executor."""

    def __init__(self, orch: Orchestrator, engines: dict[str, Engine], trainer: Trainer, source: PromptSource,
                 reward_fn: RewardFn, *, run: RunConfig, paths: RunPaths, rollout: RolloutConfig | None = None,
                 controller: ControllerConfig | None = None, observability: ObservabilityConfig | None = None,
                 algo: AlgoConfig | None = None, push: PushOptions | None = None, timeline: Timeline | None = None,
                 on_step: Callable[[StepRecord, MetricsRecorder], None] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None, first_prompt: int = 0,
                 codec: TextCodec | None = None, journal: Journal | None = None, metrics: MetricsRecorder | None = None,
                 load_reports: LoadReports | None = None, rollout_dump: RolloutDumper | None = None,
                 workflow: WorkflowRunner | None = None, events: EventQueue) -> None:
        """The config sections, each handed to the components that read it: ``run`` (the steps, the
        seed, the checkpoint interval), ``rollout`` (sampling, the request timeout, group
        speculation), ``controller`` (migrations, timeouts, weight transport and checks),
        ``observability`` (the stats interval), ``algo`` (routed experts); a section left out is
        the config's default. ``paths``: the run's snapshot and checkpoint directories;
        ``push``: the ``distributed`` broadcast's fields (default: ``controller.bucket_mb`` and the
        trainer's own choices). ``reward_fn``: the training reward, blocking (e.g. a scorer's ``score_sync``; see
        :data:`~dora_megatron.controller.samples.RewardFn`). ``events``: the queue of the :class:`~dora_megatron.controller.loop.ControllerLoop` that
        drives this executor (made by whoever builds the controller): every task reports there.
        ``load_reports``: pushed load reports of the engines it covers, taken once per stats
        sweep instead of polling them (e.g. :class:`~dora_megatron.rollout.sharded.ClientPool`).
        ``rollout_dump``: writes some of each step's samples as the trainer is handed them
        (``observability.dump_rollouts``). ``workflow``: ``rollout.workflow``
        (:class:`~dora_megatron.workflow.runner.WorkflowRunner`); None: one ``/generate`` per
        submission (the default single turn)."""
        #: the eval set's rounds (:class:`~dora_megatron.controller.evaluation.Evaluator`,
        #: ``data.eval_path``), set by :meth:`attach_evaluator`
        self.evaluator: Evaluator | None = None
        self.workflow = workflow
        self.orch = orch
        self.engines = engines
        self.trainer = trainer
        rollout = rollout if rollout is not None else RolloutConfig()
        controller = controller if controller is not None else ControllerConfig()
        observability = observability if observability is not None else ObservabilityConfig()
        algo = algo if algo is not None else AlgoConfig()
        self.timeline = timeline
        self.codec: TextCodec = codec or CharCodec()
        #: the outstanding groups' prompts, tokens and rewards, and the batch hand-off (:mod:`.samples`)
        self.store = SampleStore(source, self.codec, reward_fn, rollout, run.seed, first_prompt)
        if algo.wants_routed_experts:  # the trainer client's spool (a client with batch files has one)
            self.store.routed_spool = trainer.routed_spool
        self.journal = journal
        #: every metric of the run (summary.json, steps.jsonl, TensorBoard) comes from these events
        self.metrics = metrics or MetricsRecorder(
            slots_per_instance=instance_slots(rollout.max_running, orch.config.cap_before_rebalance),
            rebalancer=orch.policy.rebalance)
        #: this process's back-pressure count (calls that waited for a pooled connection), read at the
        #: run's end; set by the launcher (:attr:`~dora_megatron.controller.clients.EngineClients.connection_waits`)
        self.connection_waits: Callable[[], int] | None = None
        #: how late the loop runs, ticked by :func:`~dora_megatron.controller.main.drive` (summary.json)
        self.loop_lag = LoopLag()
        self.events = events
        #: the run's tasks, its clock and its end (:mod:`.run_tasks`)
        self.tasks = RunTasks(events)
        tasks = self.tasks
        # built in the order they use each other: none needs one built after it (but the evaluator)
        #: instance membership and failures (:mod:`.pool`)
        self.pool = Pool(orch=orch, engines=engines, metrics=self.metrics, store=self.store, tasks=tasks)
        #: a workflow's trajectories between their turns (:mod:`.turns`)
        self.turns = Turns(engines=engines, events=events, metrics=self.metrics, store=self.store, pool=self.pool,
                           tasks=tasks)
        #: finished samples the journal recorded after the checkpoint resumed from (:mod:`.replay`)
        self.replay = JournalReplay(store=self.store, orch=orch, journal=journal)
        #: submissions, their answers and the workflow's turns (:mod:`.generation`)
        self.generation = Generation(rollout, algo, orch=orch, engines=engines, store=self.store, events=events,
                                     metrics=self.metrics, pool=self.pool, turns=self.turns, replay=self.replay,
                                     tasks=tasks, timeline=timeline, journal=journal, workflow=workflow)
        #: migrations and interrupts of in-flight requests (:mod:`.migration`)
        self.moves = Migrations(controller, engines=engines, store=self.store, events=events,
                                generation=self.generation, turns=self.turns, tasks=tasks, timeline=timeline,
                                workflow=workflow)
        #: switches, their checks and the ``distributed`` push (:mod:`.weight_sync`)
        push = push if push is not None else PushOptions(bucket_mb=controller.bucket_mb)
        self.weights = WeightSync(controller, paths, push, engines=engines, events=events, metrics=self.metrics, trainer=trainer, pool=self.pool,
                                  moves=self.moves, generation=self.generation, tasks=tasks, timeline=timeline)
        #: the trainer step, the checkpoint decision and the end of the run (:mod:`.training`)
        self.training = Training(run, controller, paths, orch=orch, trainer=trainer, store=self.store, events=events,
                                 metrics=self.metrics, moves=self.moves, tasks=tasks, timeline=timeline,
                                 rollout_dump=rollout_dump, on_step=on_step)
        #: the checkpoint files: the trainer's part, then controller.json (:mod:`.checkpointing`)
        self.checkpoints = CheckpointWriter(paths, trainer=trainer, events=events, tasks=tasks, timeline=timeline)
        #: what controller.json holds, cut and restored (:mod:`.controller_state`)
        self.controller_state = ControllerState(store=self.store, training=self.training, moves=self.moves,
                                                weights=self.weights, turns=self.turns, metrics=self.metrics,
                                                checkpoints=self.checkpoints, tasks=tasks, journal=journal,
                                                on_checkpoint=on_checkpoint)
        #: the event source of load reports and ticks (:mod:`.stats`)
        self.stats = StatsPoller(orch, engines, events, observability, controller, self.generation.local_shortage,
                                 load_reports, on_sweep=self.generation.drafts.release_ready)

    def attach_evaluator(self, evaluator: Evaluator) -> None:
        """The eval rounds of ``data.eval_path``, built (by whoever builds the controller) after this
        executor: the :class:`~dora_megatron.controller.evaluation.Evaluator` loads its final
        round's weights through :attr:`weights`, and a switch (:attr:`weights`) and a step
        (:attr:`training`) use it in turn, so it is handed to those two here; the executor
        itself runs the final round (:meth:`finish`) and reads its summary."""
        self.evaluator = evaluator
        self.weights.use_evaluator(evaluator)
        self.training.use_evaluator(evaluator)

    # ------------------------------------------------------------------ actions (ActionHandler)
    def execute(self, actions: list[Action]) -> None:
        """Carry out one orchestrator answer (called by the loop only). Switches to the weights the
        trainer still holds (``distributed`` transport) are collected over the whole list and done
        with one broadcast."""
        perform(self, actions)
        self.weights.flush()

    def dispatch(self, a: Dispatch) -> None:
        self.generation.dispatch(a)

    def submit(self, a: Submit) -> None:
        self.generation.submit(a)

    def migrate(self, a: Migrate) -> None:
        self.moves.migrate(a)

    def interrupt(self, a: Interrupt) -> None:
        self.moves.interrupt(a)

    def switch_version(self, a: SwitchVersion) -> None:
        self.weights.order(a)

    def release_batch(self, a: ReleaseBatch) -> None:
        self.training.release_batch(a)

    # ------------------------------------------------------------------ events' bookkeeping (loop.Executor)
    def prompt_tokens(self, group_id: str) -> int:
        return self.generation.prompt_tokens(group_id)

    def absorb(self, ev: EngineReply) -> int | None:
        tokens = self.generation.absorb(ev)
        if tokens is not None:
            self.pool.sample_finished(ev.instance)
        return tokens

    def sample_versions(self, sample_id: str) -> set[int]:
        return self.generation.sample_versions(sample_id)

    def replayed(self, sample_id: str) -> int | None:
        return self.replay.replayed(sample_id)

    def turn_current(self, sample_id: str, turn: object) -> bool:
        return self.turns.current(sample_id, turn)

    def is_current(self, instance: str, engine: object) -> bool:
        return self.pool.is_current(instance, engine)

    def switch_landed(self, ev: SwitchDone, origin: asyncio.Task[Any] | None) -> bool:
        return self.weights.landed(ev, origin)

    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task[Any] | None) -> bool:
        return self.pool.mark_failed(ev, origin)

    def register(self, ev: InstanceJoined) -> bool:
        return self.pool.register(ev)

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        """The trainer holds the new weights (:meth:`WeightSync.trained`), the step is logged
        (:meth:`Training.record_step`); a checkpoint due there is started."""
        self.weights.trained(int(ev.result["version"]), ev.result.get("checksum"))
        new_version, due = self.training.record_step(ev, live_versions)
        if due:
            # Trainer first, then the controller state, both at the same boundary: weights
            # ``new_version`` exist and the orchestrator has not yet reacted to them (resume
            # replays ``on_step_finished(new_version)``).
            self.tasks.spawn(self.checkpoints.save_trainer(new_version), f"checkpoint-v{new_version}")
        return new_version, due

    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        self.controller_state.write(version, orchestrator_snapshot)

    def step_boundary(self) -> bool:
        return self.training.step_boundary()

    def now(self) -> float:
        """Seconds of the run (:meth:`RunTasks.now`; the loop times its events with it)."""
        return self.tasks.now()

    # ------------------------------------------------------------------ what launchers post
    def add_instance(self, name: str, engine: Engine) -> None:
        """Elastic pools: ``engine`` joins the running job as ``name`` (new, or a failed name coming
        back); the orchestrator switches it to the version it assigns, then routes work to it.
        Goes through the loop (:class:`InstanceJoined`), after any failure reported before it."""
        self.events.post(InstanceJoined(name, engine))

    def report_failure(self, instance: str, why: str, engine: Engine | None = None) -> None:
        """For launchers (a supervisor saw the process exit, a node restarted it): ``instance``
        failed. Goes through the loop like every other event."""
        self.events.post(InstanceFailed(instance, why, engine))

    # ------------------------------------------------------------------ the run: start, end, summary
    def begin(self) -> None:
        """What comes before the loop reads its first event (:func:`~dora_megatron.controller.main.drive`):
        the clock starts, the instances absent at start fail, ``Start`` or ``Resume`` is posted (a
        resumed run whose every step was done ends at once)."""
        resumed = self.controller_state
        self.tasks.start_clock()
        self.training.idle_since(self.tasks.resumed_from_s)
        for iid in self.engines:
            self.metrics.instance_joined(iid, self.now())
        for iid, why in self.pool.absent_at_start.items():  # before Start / Resume: never given work
            self.events.post(InstanceFailed(iid, f"not ready when the job started: {why}"))
        if self.timeline is not None:
            start = self.now()  # a resumed run starts at the checkpoint's wall time, not at 0
            if resumed.resumed and start > 0:
                self.timeline.span("trainer", "before the resume (previous run)", 0.0, start, kind="resumed")
            for iid in self.engines:
                v = self.pool.instance_version(iid)
                if v is not None:
                    self.timeline.set_version(iid, v, start)
        if resumed.resumed and self.training.steps_done >= self.training.run.steps:
            # every step was done before the checkpoint: nothing to dispatch, and no
            # on_step_finished will ever come to end the run
            self.tasks.ended.set()
        elif resumed.resumed:
            self.training.idle_since(self.now())
            pending = resumed.pending_step_finished if self.training.steps_done < self.training.run.steps else None
            self.events.post(Resume(tuple(i for i in self.engines if i not in self.pool.absent_at_start), pending))
        else:
            self.events.post(Start())

    async def finish(self, loop_error: BaseException | None = None) -> dict[str, Any]:
        """After the loop ended: stop what still runs; raise the run's error (``loop_error``, the
        loop's own failure, counts as one given to :meth:`stop`: the first wins) or evaluate the
        final weights and return the summary."""
        tasks = self.tasks
        if loop_error is not None:
            tasks.fail(loop_error)
        if tasks.error is not None:
            if self.evaluator is not None:
                self.evaluator.cancel()
            await self._cancel_all()
            raise tasks.error
        wall = self.now()
        await self._cancel_all()
        if tasks.error is not None:  # the last checkpoint's write failed: the run did not complete
            raise tasks.error
        if self.timeline is not None:
            self.timeline.close(wall)
        if self.evaluator is not None and self.training.stop_reason is None:  # the final weights, once the rollout stopped (not in the run's wall time; not on a stop)
            await self.evaluator.finish(self.training.steps_done, self.weights.latest_version or max(
                (v for v in map(self.pool.instance_version, self.engines) if v is not None), default=0))
        return self.summary(wall)

    def summary(self, wall: float) -> dict[str, Any]:
        """The run summary after ``wall`` seconds (:func:`~dora_megatron.controller.summary.run_summary`
        over the components)."""
        return run_summary(wall, orch=self.orch, metrics=self.metrics, engines=self.engines, moves=self.moves,
                           weights=self.weights, generation=self.generation, pool=self.pool, stats=self.stats,
                           replay=self.replay, training=self.training, turns=self.turns, loop_lag=self.loop_lag,
                           evaluator=self.evaluator, workflow=self.workflow, connection_waits=self.connection_waits)

    async def _cancel_all(self) -> None:
        """Abort what is still generating (outstanding groups of the next steps) and stop tasks.
        Every instance at once: one after the other, 4,096 instances took minutes to stop."""
        async def abort_all(engine: Engine) -> None:
            try:
                await asyncio.wait_for(engine.abort(abort_all=True), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

        with collector_paused():  # the in-flight requests' objects are dropped, not scanned (:mod:`.shutdown`)
            await asyncio.gather(*(abort_all(e) for iid, e in list(self.engines.items()) if not self.pool.is_failed(iid)))
            await self.tasks.cancel_all()
        # a state file still being written is finished, not cut off (its thread is no task); the
        # last checkpoint's failure is the run's error unless it has one already
        failed = await asyncio.to_thread(self.checkpoints.close)
        if failed is not None:
            log.error("the last checkpoint's controller.json was not written: %s", failed)
            self.tasks.fail(failed)
