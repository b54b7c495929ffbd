"""The controller's one entry point: every launcher (``dora train`` locally, a SLURM job's controller
node, ``dora bench`` through the local launcher, ``tools/controller_scale.py``) starts its processes
and then calls :func:`run_controller`, which runs the rest of the job in this process.

WHY one: the controller is built, fed and shut down the same way whoever started the processes,
so a SLURM job and a local job decide alike. What needs the processes themselves (waiting for them
to start, restarting a dead engine, naming why the trainer died) is the launcher's, handed in as a
:class:`Launcher`; this module never imports a launcher (``.importlinter``).

::

    launcher: start processes --> run_controller: clients, wait_ready --> build_controller (queue,
        orchestrator, Runtime) --> the launcher's event sources, stop signals --> drive:
        Runtime.begin --> ControllerLoop, stats poller, end watcher --> Runtime.finish --> close
        --> RunOutputs.finish (summary.json, export, timeline)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Protocol

from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.build import Endpoints
from dora_megatron.controller.clients import EngineClients, connection_plan
from dora_megatron.events import Stop
from dora_megatron.controller.loop import ControllerLoop, EventQueue
from dora_megatron.controller.malloc_tuning import fix_mmap_threshold
from dora_megatron.controller.outputs import RunOutputs

if TYPE_CHECKING:
    from dora_megatron.controller.records import Engine
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.launch.stop import StopSignals
    from dora_megatron.processes import ProcessSet

__all__ = ["Endpoints", "Launcher", "connection_plan", "drive", "run_controller"]

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
    from dora_megatron.controller.build import build_controller
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

