"""The launcher's side of a controller run, for a launcher whose processes are its own children
(:class:`~dora_megatron.processes.ProcessSet`): the local launcher, a SLURM job's controller node
and ``tools/controller_scale.py`` hand a :class:`ProcessLauncher` to
:func:`~dora_megatron.controller.main.run_controller`.

WHY here and not in the controller: waiting for processes to start, restarting a dead engine and
naming why the trainer died need the processes (their exit status, log tail, argv); the
controller sees only instances (:mod:`.supervise`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from dora_megatron.config.schema import DoraConfig
from dora_megatron.launch.trainer_restart import TrainerLost, watch_trainer
from dora_megatron.processes import ChildFailed, ProcessSet
from dora_megatron.rollout.health import wait_ready


class ProcessLauncher:
    """:class:`~dora_megatron.controller.main.Launcher` over the children ``procs`` of this launcher.
    Restarted engines come back on ``host``, on their planned port when ``fixed_ports`` (SLURM jobs:
    instances on this node come back on their planned port and host)."""

    def __init__(self, cfg: DoraConfig, procs: ProcessSet, run_dir: Path, *, host: str = "127.0.0.1",
                 fixed_ports: bool = False) -> None:
        from dora_megatron.launch.supervise import RestartPolicy

        from dora_megatron.ports import job_port_range

        self.cfg, self.procs, self.run_dir = cfg, procs, run_dir
        #: where an instance that is not a child here is now, and why it is down (SLURM: published by
        #: its node, :mod:`.addresses`); None: its URL is fixed and only ``/health`` tells
        self.locate: Callable[[str], tuple[str | None, str, bool]] | None = None
        self.health_path = cfg.vllm.health_path if cfg.rollout.engine == "vllm" else "/health"
        self.policy = RestartPolicy(enabled=cfg.launch.restart_engines, max_restarts=cfg.launch.max_engine_restarts,
                                    startup_timeout_s=cfg.rollout.startup_timeout_s,
                                    fixed_port=bool(cfg.rollout.base_port) or fixed_ports, host=host,
                                    health_path=self.health_path, port_range=job_port_range(cfg.launch.port_range))

    def _restarted(self) -> None:
        write_processes(self.run_dir, self.procs)

    async def wait_started(self, urls: dict[str, str], trainer_url: str):
        from dora_megatron.launch.startup import wait_for_instances
        from dora_megatron.launch.supervise import restart_engine

        cfg, procs, policy = self.cfg, self.procs, self.policy
        return await _first_error(
            wait_for_instances(urls, procs, min_ready=cfg.launch.min_ready_instances,
                               timeout_s=cfg.rollout.startup_timeout_s, health_path=self.health_path,
                               restart=(lambda n: restart_engine(procs, n, policy)) if policy.enabled else None,
                               max_restarts=cfg.launch.max_engine_restarts, on_restarted=self._restarted,
                               locate=self.locate),
            wait_ready(trainer_url, timeout_s=cfg.launch.trainer_startup_timeout_s, interval_s=0.25,
                       alive=_trainer_alive(procs), what="trainer"),
        )

    def event_sources(self, runtime: Any, make_engine: Callable[[str], Any], started: Any) -> list:
        """The engine supervisor (restarts engines that die, one budget per instance with the start-up
        restarts included) and the trainer watchdog (``controller.trainer_timeout_s``)."""
        from dora_megatron.launch.supervise import EngineSupervisor

        supervisor = EngineSupervisor(self.procs, runtime, self.policy, make_engine, list(started.urls),
                                      on_restarted=self._restarted)
        supervisor.attempts.update(started.attempts)
        if self.policy.enabled and started.attempts:
            runtime.pool.engine_restarts = sum(started.attempts.values())
        for name, why in sorted(started.absent.items()):
            supervisor.expect(name, started.urls[name], why)
        return [supervisor.run(), watch_trainer(runtime.trainer.health, self.cfg.controller.trainer_timeout_s,
                                                runtime.tasks.stop)]

    async def trainer_failure(self, err: Exception, answered: str | None) -> BaseException:
        return await trainer_failure(self.procs, err, wait_s=5.0 if answered is not None else 30.0, answered=answered)

    async def trainer_exited(self, timeout_s: float) -> None:
        await _wait_exit(self.procs, "trainer", timeout_s)


def write_processes(run_dir: Path, procs: ProcessSet) -> None:
    """``processes.json``: the pid of the controller and of every child (rewritten after a restart)."""
    tmp = run_dir / "processes.json.tmp"
    tmp.write_text(json.dumps({"controller": os.getpid(), **{c.name: c.popen.pid for c in procs.children}}, indent=1))
    os.replace(tmp, run_dir / "processes.json")


async def trainer_failure(procs: ProcessSet, err: Exception, wait_s: float = 30.0,
                           answered: str | None = None) -> ChildFailed:
    """The trainer stopped answering (or ``answered`` with an error): name the cause. A local
    trainer process that died (a rank killed, out of memory) takes torchrun down within seconds;
    its exit status and log tail say why, which the connection error alone does not. A dead or
    silent trainer is :class:`TrainerLost` (restartable); one that answered an error and lives on
    is a plain :class:`ChildFailed` (a restart would repeat it)."""
    child = next((c for c in procs.children if c.name == "trainer"), None)
    deadline = time.monotonic() + wait_s
    while child is not None and child.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    if child is not None and not child.alive():
        return TrainerLost(child.failure())
    if answered is not None:
        return ChildFailed(answered)
    return TrainerLost(f"the trainer stopped answering ({err})")


def _trainer_alive(procs: ProcessSet) -> Callable[[], bool]:
    """:func:`wait_ready`'s ``alive`` for the trainer: a trainer child that exited ends the start with
    :class:`ChildFailed`, naming it (an engine that exits is the start-up wait's: it is restarted)."""
    def alive() -> bool:
        for c in procs.children:
            if c.name == "trainer" and not c.alive():
                raise ChildFailed(c.failure())
        return True
    return alive


async def _first_error(instances, trainer):
    """Await both waits; the first that fails ends the other (a dead trainer does not wait for the
    instances' timeout). Returns the instances' result."""
    tasks = [asyncio.ensure_future(instances), asyncio.ensure_future(trainer)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        return await tasks[0]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_exit(procs: ProcessSet, name: str, timeout_s: float) -> None:
    """Wait (bounded) for the local child ``name`` to exit on its own; the launcher stops it after."""
    child = next((c for c in procs.children if c.name == name), None)
    deadline = time.monotonic() + timeout_s
    while child is not None and child.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
