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
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.checkpointing import CheckpointWriter
from dora_megatron.controller.controller_state import ControllerState
from dora_megatron.controller.generation import Generation
from dora_megatron.events import (EngineReply, InstanceFailed, InstanceJoined, Resume, Start, Stop, SwitchDone,
                                  TrainerDone)
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.loop_lag import LoopLag
from dora_megatron.controller.migration import Migrations
from dora_megatron.controller.pool import Pool
from dora_megatron.controller.records import Engine, LoadReports, RunPaths, Trainer, instance_slots
from dora_megatron.controller.replay import JournalReplay
from dora_megatron.controller.samples import RewardFn, SampleStore
from dora_megatron.controller.shutdown import cancel_in_batches, collector_paused
from dora_megatron.controller.stats import StatsPoller
from dora_megatron.controller.summary import run_summary
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.controller.training import Training
from dora_megatron.controller.turns import Turns
from dora_megatron.controller.weight_sync import WeightSync
from dora_megatron.data.codec import CharCodec, TextCodec
from dora_megatron.data.tasks import PromptSource
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.rollout_dump import RolloutDumper
from dora_megatron.observability.summary import StepRecord
from dora_megatron.orchestrator import (Action, Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion, perform)

if TYPE_CHECKING:
    from dora_megatron.controller.evaluation import Evaluator
    from dora_megatron.controller.journal import Journal
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
    :attr:`stats` (:mod:`.stats`), over the samples of :attr:`store` (:mod:`.samples`). It owns
    only the run's tasks, its clock and its end (:meth:`stop`). Components never import each
    other at run time: what one asks of another it asks of the sibling its ``*Host`` protocol
    names (e.g. the moves' ``generation``, a switch's ``moves``), reached through this executor.
    Each component is handed the config sections it reads, the loaded config's own objects (no
    copy of their values is kept here)."""

    def __init__(self, orch: Orchestrator, engines: dict[str, Engine], trainer: Trainer, source: PromptSource,
                 reward_fn: RewardFn, *, run: RunConfig, paths: RunPaths, rollout: RolloutConfig | None = None,
                 controller: ControllerConfig | None = None, observability: ObservabilityConfig | None = None,
                 algo: AlgoConfig | None = None, push: PushOptions | None = None, timeline: Timeline | None = None,
                 on_step: Callable[[StepRecord, "Runtime"], None] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None, first_prompt: int = 0,
                 codec: TextCodec | None = None, journal: Journal | None = None, metrics: MetricsRecorder | None = None,
                 load_reports: LoadReports | None = None, rollout_dump: RolloutDumper | None = None,
                 events: EventQueue) -> None:
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
        (``observability.dump_rollouts``)."""
        self.rollout_dump = rollout_dump
        #: the eval set's rounds (:class:`~dora_megatron.controller.evaluation.Evaluator`, ``data.eval_path``)
        self.evaluator: Evaluator | None = None
        #: ``rollout.workflow`` (:class:`~dora_megatron.workflow.runner.WorkflowRunner`); None: one
        #: ``/generate`` per submission (the default single turn)
        self.workflow: WorkflowRunner | None = None
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
            self.store.routed_spool = getattr(trainer, "routed_spool", None)
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
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self._t0 = 0.0
        self.events = events
        #: submissions, their answers and the workflow's turns (:mod:`.generation`)
        self.generation = Generation(self, rollout, algo)
        #: the trainer step, the checkpoint decision and the end of the run (:mod:`.training`)
        self.training = Training(self, run, controller, paths, on_step)
        #: instance membership and failures (:mod:`.pool`)
        self.pool = Pool(self)
        #: the event source of load reports and ticks (:mod:`.stats`)
        self.stats = StatsPoller(orch, engines, self.events, observability, controller, self.generation.local_shortage,
                                 load_reports, on_sweep=self.generation.drafts.release_ready)
        #: switches, their checks and the ``distributed`` push (:mod:`.weight_sync`)
        self.weights = WeightSync(self, controller, paths,
                                  push if push is not None else PushOptions(bucket_mb=controller.bucket_mb))
        #: migrations and interrupts of in-flight requests (:mod:`.migration`)
        self.moves = Migrations(self, controller)
        #: a workflow's trajectories between their turns (:mod:`.turns`)
        self.turns = Turns(self)
        #: the checkpoint files: the trainer's part, then controller.json (:mod:`.checkpointing`)
        self.checkpoints = CheckpointWriter(self, paths)
        #: what controller.json holds, cut and restored (:mod:`.controller_state`)
        self.controller_state = ControllerState(self, on_checkpoint)
        #: finished samples the journal recorded after the checkpoint resumed from (:mod:`.replay`)
        self.replay = JournalReplay(self)

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

    def turn_current(self, sample_id: str, turn: Any) -> bool:
        return self.turns.current(sample_id, turn)

    def is_current(self, instance: str, engine: Engine) -> bool:
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
            self.spawn(self.checkpoints.save_trainer(new_version), f"checkpoint-v{new_version}")
        return new_version, due

    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        self.controller_state.write(version, orchestrator_snapshot)

    def step_boundary(self) -> bool:
        return self.training.step_boundary()

    # ------------------------------------------------------------------ what components ask of each other
    def now(self) -> float:
        """Seconds of the run (a resumed run goes on from its checkpoint's wall time)."""
        return time.monotonic() - self._t0 + self.controller_state.wall_s

    def spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[None]:
        """A task of the run: its failure stops the run with its cause; :meth:`finish` cancels it."""
        task = asyncio.get_running_loop().create_task(self._guard(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro: Coroutine[Any, Any, object]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - any failure stops the run with its cause
            log.exception("runtime task failed")
            self.stop(err)

    # ------------------------------------------------------------------ what launchers call
    def is_failed(self, instance: str) -> bool:
        """:meth:`Pool.is_failed` (what the launchers' pollers ask of a run, per instance)."""
        return self.pool.is_failed(instance)

    def add_instance(self, name: str, engine: Engine) -> None:
        """Elastic pools: ``engine`` joins the running job as ``name`` (new, or a failed name coming
        back); the orchestrator switches it to the version it assigns, then routes work to it.
        Goes through the loop (:class:`InstanceJoined`), after any failure reported before it."""
        self.events.post(InstanceJoined(name, engine))

    def report_failure(self, instance: str, why: str, engine: Engine | None = None) -> None:
        """For launchers (a supervisor saw the process exit, a node restarted it): ``instance``
        failed. Goes through the loop like every other event."""
        self.events.post(InstanceFailed(instance, why, engine))

    def all_failed(self) -> bool:
        """For a supervising launcher: :meth:`Pool.all_failed`."""
        return self.pool.all_failed()

    def request_stop(self, reason: str) -> None:
        """For the launcher's stop signals: :meth:`Training.request_stop` (at the next step boundary)."""
        self.training.request_stop(reason)

    # ------------------------------------------------------------------ the run: start, end, error
    @property
    def ended(self) -> asyncio.Event:
        """Set once the run ends (:meth:`stop`): a :class:`ControllerLoop` runs until it is."""
        return self._done

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
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

    def begin(self) -> None:
        """What comes before the loop reads its first event (:func:`~dora_megatron.controller.main.drive`):
        the clock starts, the instances absent at start fail, ``Start`` or ``Resume`` is posted (a
        resumed run whose every step was done ends at once)."""
        resumed = self.controller_state
        self._t0 = time.monotonic()
        self.training.idle_since(resumed.wall_s)
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
            self._done.set()
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
        if loop_error is not None and self._error is None:
            self._error = loop_error
        if self._error is not None:
            if self.evaluator is not None:
                self.evaluator.cancel()
            await self._cancel_all()
            raise self._error
        wall = self.now()
        await self._cancel_all()
        if self._error is not None:  # the last checkpoint's write failed: the run did not complete
            raise self._error
        if self.timeline is not None:
            self.timeline.close(wall)
        if self.evaluator is not None and self.training.stop_reason is None:  # the final weights, once the rollout stopped (not in the run's wall time; not on a stop)
            await self.evaluator.finish(self.training.steps_done, self.weights.latest_version or max(
                (v for v in map(self.pool.instance_version, self.engines) if v is not None), default=0))
        return run_summary(self, wall)

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
            await cancel_in_batches(list(self._tasks))
        # a state file still being written is finished, not cut off (its thread is no task); the
        # last checkpoint's failure is the run's error unless it has one already
        failed = await asyncio.to_thread(self.checkpoints.close)
        if failed is not None:
            log.error("the last checkpoint's controller.json was not written: %s", failed)
            if self._error is None:
                self._error = failed
