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
import logging
from pathlib import Path
from typing import Any, Callable, Coroutine, Protocol

from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.build import Endpoints
from dora_megatron.controller.clients import EngineClients, connection_plan
from dora_megatron.controller.loop import ControllerLoop, Stop
from dora_megatron.controller.outputs import RunOutputs

__all__ = ["Endpoints", "Launcher", "connection_plan", "drive", "run_controller"]

log = logging.getLogger(__name__)


class Launcher(Protocol):
    """What the controller needs of the launcher that started the processes."""

    procs: Any  # its ProcessSet (clients that restart vLLM instances use it), or None

    async def wait_started(self, urls: dict[str, str], trainer_url: str) -> Any:
        """Until the engines (or ``launch.min_ready_instances`` of them) and the trainer answer;
        returns ``urls``, ``ready``, ``absent`` (name -> why), ``loading`` and ``attempts``
        (:class:`~dora_megatron.launch.startup.Instances`)."""

    def event_sources(self, runtime: Any, make_engine: Callable[[str], Any], started: Any) -> list[Coroutine]:
        """The launcher's event sources while the runtime runs (engine supervisor, trainer watchdog,
        a SLURM job's join watcher)."""

    async def trainer_failure(self, err: Exception, answered: str | None) -> BaseException:
        """Why the trainer stopped answering (``answered``: it answered with this error)."""

    async def trainer_exited(self, timeout_s: float) -> None:
        """Wait (bounded) for a trainer that acknowledged its shutdown to exit by itself."""


async def drive(runtime: Any) -> dict[str, Any]:
    """Run the controller loop over the executor ``runtime`` (a built
    :class:`~dora_megatron.controller.runtime.Runtime`) until the last step (or an error); returns
    the summary. Every run goes through here: the launchers (:func:`run_controller`) and the tests
    that run a runtime on fakes.

    The loop reads the runtime's queue; beside it run the stats poller (load reports and ticks)
    and the end watcher: a run ended from outside the loop (a supervisor's :meth:`stop`) posts
    ``Stop`` so that the loop wakes. A failing event handler ends the run with its cause."""
    runtime.begin()
    done = runtime.ended
    loop = ControllerLoop(runtime.orch, runtime, runtime.events, done)
    tasks = [asyncio.get_running_loop().create_task(runtime.stats.run(done)),
             asyncio.get_running_loop().create_task(_stop_when(done, runtime.events))]
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


async def _stop_when(done: asyncio.Event, events: Any) -> None:
    """The loop sleeps on its queue: a run ended without an event (``done`` set) must wake it."""
    await done.wait()
    events.post(Stop())


async def run_controller(cfg: DoraConfig, endpoints: Endpoints, run_dir: Path, model_dir: Path, launcher: Launcher,
                         say: Callable[[str], None], checkpoint: Path | None = None, *,
                         on_runtime: Callable[[Any], None] | None = None, stop_signals: Any = None,
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
    if ctl.state is not None and ctl.journal is not None:
        say(f"journal: {ctl.restorable_samples} finished sample(s) after {checkpoint.name} may be restored")
    if on_runtime is not None:
        on_runtime(runtime)
    runtime.pool.start_without(started.absent, started.loading)
    loop = asyncio.get_running_loop()
    sources = [loop.create_task(c) for c in launcher.event_sources(runtime, clients.make, started)]
    if stop_signals is not None:
        stop_signals.arm_runtime(runtime)
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
    summary.update(reward_fn=ctl.reward_name, trainer_restarts=trainer_restarts, data_skipped_rows=skipped_rows(ctl.source))
    return outputs.finish(summary, model_dir, say)

