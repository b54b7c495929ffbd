"""The controller's one entry point: every launcher (``dora train`` locally, a SLURM job's controller
node, ``dora bench`` through the local launcher, ``tools/controller_scale.py``) starts its processes
and then calls :func:`run_controller`, which runs the rest of the job in this process.

WHY one: the controller is built, fed and shut down the same way whoever started the processes,
so a SLURM job and a local job decide alike. What the controller is made of (engine and trainer
clients, prompts and reward, the orchestrator, restored from a checkpoint or new, the journal, the
event queue, the runtime) is decided once, in :func:`build_controller`, which hands each of the
runtime's components the config sections it reads; launchers pass only :class:`Endpoints`. What
needs the processes themselves (waiting for them to start, restarting a dead engine, naming why the
trainer died) is the launcher's, handed in as a :class:`Launcher`; this module never imports a
launcher (``.importlinter``).

::

    launcher: start processes --> run_controller: clients, wait_ready --> build_controller (queue,
        orchestrator, Runtime) --> the launcher's event sources, stop signals --> drive:
        Runtime.begin --> ControllerLoop, stats poller, end watcher --> Runtime.finish --> close
        --> RunOutputs.finish (summary.json, export, timeline)
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Protocol, Sequence
from urllib.parse import urlsplit

from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.clients import EngineClients, connection_plan
from dora_megatron.controller.loop import ControllerLoop, EventQueue
from dora_megatron.controller.malloc_tuning import fix_mmap_threshold
from dora_megatron.controller.outputs import RunOutputs
from dora_megatron.controller.records import RunPaths, instance_slots
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.events import Stop
from dora_megatron.observability.summary import StepRecord

if TYPE_CHECKING:
    from dora_megatron.controller.journal import Journal
    from dora_megatron.controller.records import Engine, LoadReports
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.controller.trainer_client import TrainerClient
    from dora_megatron.data.codec import TextCodec
    from dora_megatron.data.reward_api import RewardScorer
    from dora_megatron.data.tasks import PromptSource
    from dora_megatron.launch.stop import StopSignals
    from dora_megatron.observability.background import BackgroundWriter
    from dora_megatron.observability.recorder import MetricsRecorder
    from dora_megatron.observability.tensorboard import ScalarWriter
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.orchestrator import Orchestrator
    from dora_megatron.processes import ProcessSet

__all__ = ["Controller", "Endpoints", "Launcher", "build_controller", "connection_plan", "drive", "push_options",
           "run_controller"]

log = logging.getLogger(__name__)

#: the GIL's switch interval while the controller runs (Python's default: 5 ms)
SWITCH_INTERVAL_S = 0.0005
#: allocations between two young collections while the controller runs (Python's default: 700).
#: WHY: an in-flight request holds ~80 tracked objects (its task's coroutines, aiohttp's) for
#: seconds, so they outlive young collections anyway; fewer young collections promote them with
#: less scanning, and the full ones that follow them came 2 times a run instead of 5
#: (``tools/controller_scale.py``'s ``gc_collections``, ``docs/results/controller_scale.md``)
GC_THRESHOLD0 = 7000


class Started(Protocol):
    """The instances once the launcher's start-up wait is over
    (:class:`~dora_megatron.launch.startup.StartupResult`)."""

    urls: dict[str, str]  # every instance, restarted ones at their new URL
    ready: set[str]
    absent: dict[str, str]  # not ready: name -> why
    loading: set[str]  # absent ones that never failed, only came up late


class Launcher(Protocol):
    """What the controller needs of the launcher that started the processes."""

    procs: ProcessSet | None  # clients that restart vLLM instances use it

    async def wait_started(self, urls: dict[str, str], trainer_url: str) -> Started:
        """Until the engines (or ``launch.min_ready_instances`` of them) and the trainer answer;
        returns what the controller reads of them (:class:`Started`)."""

    def event_sources(self, runtime: Runtime, make_engine: Callable[[str], Engine],
                      started: Started) -> list[Coroutine[Any, Any, None]]:
        """The launcher's event sources while the runtime runs (engine supervisor, trainer watchdog,
        a SLURM job's join watcher)."""

    async def trainer_failure(self, err: Exception, answered: str | None) -> BaseException:
        """Why the trainer stopped answering (``answered``: it answered with this error)."""

    async def trainer_exited(self, timeout_s: float) -> None:
        """Wait (bounded) for a trainer that acknowledged its shutdown to exit by itself."""


@dataclass(frozen=True)
class Endpoints:
    """Where the processes a launcher started answer: instance name -> engine base URL, and the
    trainer's URL."""

    engines: dict[str, str]
    trainer: str


def push_options(cfg: DoraConfig, trainer_url: str) -> PushOptions:
    """The fields of every ``distributed`` broadcast of the run (``controller.weight_transport``),
    derived from several sections: the bucket size (``controller``), where engines reach the
    trainer's rendezvous (its URL's host; the fixed port of ``cluster`` under SLURM), and on SGLang
    the group's backend, ranks per engine and pause mode (``sglang``)."""
    sglang = cfg.rollout.engine == "sglang"
    return PushOptions(
        bucket_mb=cfg.controller.bucket_mb, master_addr=urlsplit(trainer_url).hostname,
        master_port=(cfg.cluster.weight_group_port or None) if cfg.launch.backend == "slurm" else None,
        backend=cfg.sglang.weight_group_backend if sglang else None,
        engine_ranks=cfg.sglang.tp_size if sglang else 1, pause_mode=cfg.sglang.pause_mode if sglang else None)


def prompt_source(cfg: DoraConfig, codec: TextCodec) -> tuple[PromptSource, RewardScorer, str]:
    """``data``: the prompts (rendered by ``codec`` when a dataset is checked at load), the reward
    scorer (:class:`~dora_megatron.data.reward_api.RewardScorer`; its worker processes start here)
    and the reward in words."""
    from dora_megatron.data.sources import make_scorer
    from dora_megatron.data.sources import prompt_source as data_prompt_source

    source = data_prompt_source(cfg, codec)
    scorer, name = make_scorer(cfg.data)
    return source, scorer, name


@dataclass
class Controller:
    """A built controller: :func:`~dora_megatron.controller.main.drive` runs it;
    :meth:`close` releases its journal and reward workers."""

    runtime: Runtime
    trainer: TrainerClient
    engines: dict[str, Engine]
    reward_name: str
    scorer: RewardScorer | None = None  # its worker processes end with close
    source: PromptSource | None = None  # the prompts (data_skipped_rows)
    state: dict[str, Any] | None = None  # the checkpoint's controller.json it resumed from
    journal: Journal | None = None
    restorable_samples: int = 0  # finished samples the journal may restore (resume)

    @property
    def orch(self) -> Orchestrator:
        return self.runtime.orch

    def close(self) -> None:
        """Release the journal and the reward's worker processes."""
        if self.journal is not None:
            self.journal.close()
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()


def build_controller(cfg: DoraConfig, endpoints: Endpoints, *, run_dir: Path, model_dir: Path,
                     make_engine: Callable[[str], Engine], checkpoint: Path | None = None,
                     on_step: Callable[[StepRecord, MetricsRecorder], None] | None = None,
                     on_checkpoint: Callable[[int], None] | None = None, timeline: Timeline | None = None,
                     metric_sinks: Sequence[ScalarWriter] = (), load_reports: LoadReports | None = None,
                     background: BackgroundWriter | None = None,
                     eval_sinks: Sequence[ScalarWriter] | None = None) -> Controller:
    """Clients for ``endpoints``, prompts, the orchestrator (restored from ``checkpoint`` when
    given, with its journal), and the runtime that executes its actions.

    ``make_engine(url)``: the launcher's engine-client factory (local runs hand it the processes
    it may restart). ``on_step(step_log, metrics)`` after each trained step, ``on_checkpoint(version)``
    at each checkpoint's cut, in its loop turn (the launcher's snapshot retention reads the live versions then).
    ``metric_sinks``: where the metrics recorder writes each step's scalars (TensorBoard, steps.jsonl).
    ``load_reports``: pushed load reports replacing the stats polls of the engines they cover
    (``rollout.client_workers``, :class:`~dora_megatron.rollout.sharded.ClientPool`).
    ``background``: the launcher's :class:`~dora_megatron.observability.background.BackgroundWriter`;
    the rollout dumps are written on it, off the event loop (the launcher closes it).
    ``eval_sinks``: where the eval set's rounds write ``eval/...`` (default ``metric_sinks``; a
    launcher leaves out the per-step file)."""
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.controller.trainer_client import TrainerClient
    from dora_megatron.data.sources import job_codec
    from dora_megatron.observability.recorder import MetricsRecorder
    from dora_megatron.orchestrator import Orchestrator

    engines = {name: make_engine(url) for name, url in endpoints.engines.items()}
    trainer = TrainerClient(endpoints.trainer, batch_dir=run_dir / "batches")
    codec = job_codec(cfg, model_dir)
    source, scorer, reward_name = prompt_source(cfg, codec)
    from dora_megatron.data.sources import eval_prompts

    evals = eval_prompts(cfg, codec)  # checked whole at load, like the training prompts
    state_file = checkpoint / "controller.json" if checkpoint is not None else None
    state = json.loads(state_file.read_text()) if state_file is not None else None
    if state is not None:
        from dora_megatron.controller.controller_state import check_format

        try:  # before anything reads it: a file (or an orchestrator snapshot) an older dora wrote, by name
            check_format(state)
            orch = Orchestrator.restore(cfg.orchestrator, state["orchestrator"])
        except ValueError as err:
            raise ValueError(f"{state_file}: {err}") from err
    else:
        orch = Orchestrator(cfg.orchestrator, list(endpoints.engines))
    journal = None
    if cfg.controller.journal and cfg.run.checkpoint_interval > 0:
        from dora_megatron.controller.journal import Journal

        journal = Journal(run_dir)
    slots = instance_slots(cfg.rollout.max_running, cfg.orchestrator.cap_before_rebalance)
    metrics = MetricsRecorder(slots_per_instance=slots, rebalancer=orch.policy.rebalance,
                              warmup_steps=cfg.observability.warmup_steps, sinks=metric_sinks)
    rollout_dump = None
    if cfg.observability.dump_rollouts > 0:
        from dora_megatron.observability.rollout_dump import RolloutDumper

        rollout_dump = RolloutDumper(run_dir, cfg.observability.dump_rollouts, codec, writer=background)
    workflow = None
    if cfg.rollout.workflow:
        from dora_megatron.workflow.runner import workflow_runner

        workflow = workflow_runner(cfg.rollout.workflow, cfg.rollout.workflow_kwargs, codec,
                                   cfg.data.chat_template_kwargs, cfg.trainer.max_seq_len)
    # each component reads its own section of the loaded config (the objects themselves)
    runtime = Runtime(orch, engines, trainer, source, scorer.score_sync, run=cfg.run,
                      paths=RunPaths(run_dir, model_dir), rollout=cfg.rollout, controller=cfg.controller,
                      observability=cfg.observability, algo=cfg.algo, push=push_options(cfg, endpoints.trainer),
                      timeline=timeline,
                      on_step=on_step, on_checkpoint=on_checkpoint, codec=codec, journal=journal, metrics=metrics,
                      load_reports=load_reports, rollout_dump=rollout_dump, workflow=workflow, events=EventQueue())
    if evals is not None:
        from dora_megatron.controller.evaluation import Evaluator

        # after the runtime: the eval rounds load their final weights through its weight sync
        runtime.attach_evaluator(Evaluator(
            evals, scorer, engines=engines, pool=runtime.pool, weights=runtime.weights, codec=codec,
            observability=cfg.observability, rollout=cfg.rollout, seed=cfg.run.seed, slots=slots,
            sinks=metric_sinks if eval_sinks is None else eval_sinks, out=run_dir / "eval.jsonl",
            path=cfg.data.eval_path))
    restorable = 0
    if state is not None:
        from dora_megatron.observability.recorder import read_step_rows

        # the recorder's rows of the steps done are steps.jsonl's (the launcher has cut the crashed
        # lineage's lines after the checkpoint); controller.json keeps only their count
        try:
            runtime.controller_state.load_state_dict(state, read_step_rows(run_dir / "steps.jsonl",
                                                                           int(state["steps_done"])))
        except ValueError as err:  # an entry this version cannot read: which file, then which entry and key
            raise ValueError(f"{state_file}: {err}") from err
    if journal is not None:
        if state is not None and runtime.workflow is None:  # what the crashed lineage finished after this
            # checkpoint (a workflow's samples are not journaled: they run again), then start anew
            from dora_megatron.controller.journal import read_journal

            samples = read_journal(run_dir, int(state["version"]))
            runtime.replay.load(samples)
            restorable = len(samples)
        journal.start(int(state["version"]) if state is not None else None)
    spool = runtime.store.routed_spool
    if state is not None and spool is not None:  # every sample naming the spool is held again: the rest goes
        spool.resumed()
    return Controller(runtime, trainer, engines, reward_name, scorer, source, state, journal, restorable)


async def drive(runtime: Runtime) -> dict[str, Any]:
    """Run the controller loop over the executor ``runtime`` (a built
    :class:`~dora_megatron.controller.runtime.Runtime`) until the last step (or an error); returns
    the summary. Every run goes through here: the launchers (:func:`run_controller`) and the tests
    that run a runtime on fakes.

    The loop reads the runtime's queue; beside it run the stats poller (load reports and ticks)
    and the end watcher: a run ended from outside the loop (a supervisor's ``runtime.tasks.stop``) posts
    ``Stop`` so that the loop wakes. A failing event handler ends the run with its cause."""
    runtime.begin()
    done = runtime.tasks.ended
    loop = ControllerLoop(runtime.orch, runtime, runtime.events, done)
    tasks = [asyncio.get_running_loop().create_task(runtime.stats.run(done)),
             asyncio.get_running_loop().create_task(_stop_when(done, runtime.events)),
             asyncio.get_running_loop().create_task(runtime.loop_lag.run(done))]
    error = None
    try:
        await loop.run()
    except Exception as err:  # noqa: BLE001 - a failed event handler stops the run with its cause
        log.exception("controller loop failed")
        error = err
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return await runtime.finish(error)


async def _stop_when(done: asyncio.Event, events: EventQueue) -> None:
    """The loop sleeps on its queue: a run ended without an event (``done`` set) must wake it."""
    await done.wait()
    events.post(Stop())


async def run_controller(cfg: DoraConfig, endpoints: Endpoints, run_dir: Path, model_dir: Path, launcher: Launcher,
                         say: Callable[[str], None], checkpoint: Path | None = None, *,
                         on_runtime: Callable[[Runtime], None] | None = None, stop_signals: StopSignals | None = None,
                         trainer_restarts: int = 0) -> dict[str, Any]:
    """Run the controller of a job whose processes are started, until its last step (or a stop), and
    write the outputs; returns the summary. ``on_runtime(runtime)`` runs once the runtime exists
    (e.g. a load harness's instruments). ``stop_signals``
    (:class:`~dora_megatron.launch.stop.StopSignals`): while the runtime runs, the first signal asks
    it to stop at the next step boundary with a checkpoint (``status: stopped``; no export). A
    trainer that dies or stays silent ends it with the launcher's :meth:`Launcher.trainer_failure`
    (the caller may restart it); ``trainer_restarts``: how many times it was restarted before."""
    from dora_megatron.controller.trainer_client import TrainerError, TrainerUnreachable
    from dora_megatron.data.sources import skipped_rows

    # refuses before waiting on thousands of instances
    clients = EngineClients(cfg, model_dir, run_dir, launcher.procs, len(endpoints.engines), say)
    started = await clients.wait_ready(launcher, endpoints.engines, endpoints.trainer, say)
    endpoints = Endpoints(dict(started.urls), endpoints.trainer)
    outputs = RunOutputs(cfg, run_dir, checkpoint, trainer_restarts)
    await clients.start_pool()
    ctl = build_controller(cfg, endpoints, run_dir=run_dir, model_dir=model_dir, make_engine=clients.make,
                           checkpoint=checkpoint, on_step=outputs.on_step, on_checkpoint=outputs.on_checkpoint,
                           timeline=outputs.timeline, metric_sinks=outputs.sinks,
                           eval_sinks=[outputs.writer],  # not W&B: a round ends after later steps, W&B drops older steps
                           load_reports=clients.pool, background=outputs.background)
    runtime, trainer = ctl.runtime, ctl.trainer
    runtime.connection_waits = clients.connection_waits
    say(f"reward: {ctl.reward_name}")
    outputs.attach(ctl.orch, resumed=ctl.state is not None)
    if ctl.state is not None and ctl.journal is not None and checkpoint is not None:
        say(f"journal: {ctl.restorable_samples} finished sample(s) after {checkpoint.name} may be restored")
    if on_runtime is not None:
        on_runtime(runtime)
    runtime.pool.start_without(started.absent, started.loading)
    loop = asyncio.get_running_loop()
    sources = [loop.create_task(c) for c in launcher.event_sources(runtime, clients.make, started)]
    if stop_signals is not None:
        stop_signals.arm_runtime(runtime)
    # WHY: what exists now (imported modules, the tokenizer, the prompts, the clients: 53K tracked
    # objects in the scale harness) lives as long as the run, and every full garbage collection
    # scanned it again, holding the GIL: every thread, the event loop's included, stops for the
    # whole collection (0.2-0.4 s each on a shared core, ``docs/results/controller_scale.md``).
    # Frozen, collections scan only what the run allocates; unfrozen at the end (a process running
    # several controllers, as tests do, collects them again).
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, *thresholds[1:])
    # WHY a shorter switch interval: the loop releases the GIL on every socket call (thousands a
    # second, one per answer piece) and then waits for the threads decoding, scoring or writing to
    # give it back, up to a whole interval each time: beside 4 busy threads a loop made 8.1K socket
    # round trips a second with a tick lag p99 of 171 ms at 5 ms, 17.4K and 80 ms at 0.5 ms
    # (``docs/results/controller_scale.md``).
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # WHY: answers with routed experts leave buffers of several MB in glibc's heap once freed
    # (its dynamic mmap threshold): the RSS grew 2.2x the arrays held, 1.06x with the threshold fixed
    # (controller/malloc_tuning.py). Left fixed at the end: glibc cannot read it back, and it
    # changes only where big blocks live.
    fix_mmap_threshold()
    try:
        summary = await drive(runtime)
    except TrainerUnreachable as err:
        raise await launcher.trainer_failure(err, None) from err
    except TrainerError as err:  # the trainer answered with an error (its log has the traceback)
        raise await launcher.trainer_failure(err, f"{err} (see {run_dir / 'logs' / 'trainer.log'})")
    finally:
        if stop_signals is not None:
            stop_signals.disarm()  # from here a signal unwinds at once
        for task in sources:
            task.cancel()
        await asyncio.gather(*sources, return_exceptions=True)
        ctl.close()
        outputs.close()
        await trainer.leave(cfg.launch.shutdown_timeout_s, launcher.trainer_exited)
        await clients.close(ctl.engines)
        # last: every queued dump and checkpoint overview written (the run's work is over, the
        # loop may wait for it now; an interrupted run's cleanup above has already run)
        outputs.close_background()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(switch_interval)
    summary.update(reward_fn=ctl.reward_name, trainer_restarts=trainer_restarts, data_skipped_rows=skipped_rows(ctl.source))
    return outputs.finish(summary, model_dir, say)

