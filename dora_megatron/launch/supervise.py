"""Supervision of a local job's children: failed engines are restarted and rejoin the pool.

WHY in the launcher: only the launcher owns the processes; the runtime only sees instances.
The order matters for C2: the runtime first marks the instance failed (the orchestrator
re-queues its requests on their own version), then the process is replaced (killed first if it
is still alive, e.g. hung or failed by a weight-sync timeout), and only once the new process
answers ``/health`` does :meth:`Runtime.add_instance` bring the same name back; the orchestrator
then switches it to the version it assigns (``on_instance_joined``: the newest) like any
joining instance. Requests that ran on the old process never come back from it: its client is
replaced, and the runtime ignores failures reported through the old client.

A dead trainer ends this run of the controller with
:class:`~dora_megatron.launch.trainer_restart.TrainerLost`: the launcher restarts it from the last
complete checkpoint and runs the controller again from there, keeping these engine processes
(:mod:`.trainer_restart`).
In a SLURM job only the controller's node's instances are children here; the others are restarted
by their own node's launcher and rejoin through the join folder (``launch/slurm_run.py``), so when
every instance has failed the run waits ``rollout.startup_timeout_s`` for those before it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dora_megatron.ports import job_port_range, pick_ports
from dora_megatron.launch.trainer_restart import TrainerLost
from dora_megatron.processes import Child, ProcessSet
from dora_megatron.rollout.health import InstanceNotReady, wait_ready

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    max_restarts: int = 3  # per engine; every start attempt counts
    startup_timeout_s: float = 300.0
    fixed_port: bool = False  # True: restart on the same port; False: a fresh free port
    host: str = "127.0.0.1"
    health_path: str = "/health"  # polled until 200 after a restart (vllm: vllm.health_path)
    port_range: tuple[int, int] = field(default_factory=job_port_range)  # launch.port_range: where a fresh port is picked


def with_port(argv: list[str] | tuple[str, ...], port: int) -> list[str]:
    """``argv`` with the value after ``--port`` replaced."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def restart_engine(procs: ProcessSet, name: str, policy: RestartPolicy) -> tuple[Child, str]:
    """Replace engine ``name`` by a new process (blocking: the old one is killed and reaped first):
    on its port when ``policy.fixed_port``, else on a fresh free one. Returns the child and its URL.
    Used mid-run (:class:`EngineSupervisor`) and while the job starts (:mod:`.startup`)."""
    old = next(c for c in procs.children if c.name == name)
    port = int(old.argv[old.argv.index("--port") + 1])
    if not policy.fixed_port:  # not the old one: another process may hold it now
        port = pick_ports(1, policy.host, policy.port_range, avoid=[port])[0]
    log.warning("restarting %s on port %d", name, port)
    child = procs.restart(name, with_port(old.argv, port))
    return child, f"http://{policy.host}:{port}"


class EngineSupervisor:
    """Watches the children of ``procs``; see the module docstring.

    ``make_engine(url)`` builds the runtime's client for an engine URL; ``on_restarted()`` runs after
    each successful restart (e.g. to rewrite ``processes.json``)."""

    def __init__(self, procs: ProcessSet, runtime: Any, policy: RestartPolicy,
                 make_engine: Callable[[str], Any], engine_names: list[str],
                 on_restarted: Callable[[], None] | None = None, poll_s: float = 0.5) -> None:
        self.procs = procs
        self.runtime = runtime
        self.policy = policy
        self.make_engine = make_engine
        self.engine_names = set(engine_names)
        self.on_restarted = on_restarted
        self.poll_s = poll_s
        self.attempts: dict[str, int] = {}
        self._restarting: dict[str, asyncio.Task] = {}
        self._reported: set[int] = set()  # pids whose exit was reported
        self._all_failed_since: float | None = None
        if policy.enabled:
            runtime.pool.engine_restarts = 0
            runtime.pool.instances_may_return = True

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.poll_s)
                self.check()
        finally:
            for task in self._restarting.values():
                task.cancel()
            if self._restarting:
                await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    def check(self) -> None:
        """One pass: report exits, start restarts (no waiting here)."""
        rt = self.runtime
        for child in list(self.procs.children):
            name = child.name
            if not child.alive() and child.popen.pid not in self._reported:
                self._reported.add(child.popen.pid)
                if name == "trainer":  # the launcher may restart it (launch/trainer_restart.py)
                    rt.tasks.stop(TrainerLost(child.failure()))
                    return
                if name in self.engine_names and name in rt.engines:
                    rt.report_failure(name, f"process exited with status {child.popen.returncode}")
            if (self.policy.enabled and name in self.engine_names and name not in self._restarting
                    and self.attempts.get(name, 0) < self.policy.max_restarts and not rt.tasks.is_done()
                    and name in rt.engines and rt.pool.is_failed(name)):
                self._restarting[name] = asyncio.get_running_loop().create_task(self._restart(name),
                                                                                name=f"restart-{name}")
        # per poll, so O(1) questions only (rt.pool.failed is a scan of the whole pool)
        if not (self.policy.enabled and not self._restarting and not rt.tasks.is_done() and rt.pool.all_failed()):
            self._all_failed_since = None
            return
        # instances on other nodes (SLURM) are restarted by their own node and may still rejoin: wait
        # for them as long as one start may take, then end the run
        local = {c.name for c in self.procs.children}
        remote = [n for n in rt.engines if n not in local]
        now = time.monotonic()
        if self._all_failed_since is None:
            self._all_failed_since = now
        if remote and now - self._all_failed_since < self.policy.startup_timeout_s:
            return
        rt.tasks.stop(RuntimeError(
            f"every rollout instance failed and no restart is left (launch.max_engine_restarts="
            f"{self.policy.max_restarts}" + (f"; none of {remote} on other nodes came back within "
                                            f"rollout.startup_timeout_s={self.policy.startup_timeout_s:.0f} s"
                                            if remote else "") + ")"))

    def expect(self, name: str, url: str, why: str) -> None:
        """``name`` was not ready when the job started (``why``): add it to the pool once ``url``
        serves. A child of this launcher that exits, or does not serve within
        ``rollout.startup_timeout_s``, is left failed, and :meth:`check` restarts it while the
        budget allows; an instance of another node is waited for as long, then left to its node."""
        log.info("%s joins once it is ready (%s)", name, why)
        self._restarting[name] = asyncio.get_running_loop().create_task(self._join_late(name, url),
                                                                        name=f"join-{name}")

    async def _join_late(self, name: str, url: str) -> None:
        try:
            child = next((c for c in self.procs.children if c.name == name), None)
            if child is not None and not child.alive():
                return  # failed at the start: check() restarts it
            if not await self._healthy(url, child):
                log.warning("%s did not become healthy after the start (%s)", name, url)
                if child is not None:  # hung while loading: check() replaces it while restarts remain
                    self.runtime.report_failure(name, f"not healthy {self.policy.startup_timeout_s:.0f} s "
                                                      f"after the start")
                return
            await self._joined(name, url, restarted=False)
        except Exception:  # noqa: BLE001 - it stays out of the pool; the run goes on
            log.exception("waiting for %s to join failed", name)
        finally:
            self._restarting.pop(name, None)

    async def _restart(self, name: str) -> None:
        try:
            self.attempts[name] = self.attempts.get(name, 0) + 1
            log.warning("restarting %s (attempt %d of %d)", name, self.attempts[name], self.policy.max_restarts)
            child, url = await asyncio.to_thread(restart_engine, self.procs, name, self.policy)
            self._reported.discard(child.popen.pid)
            if not await self._healthy(url, child):
                log.warning("restarted %s did not become healthy (log %s)", name, child.log_path)
                return  # still failed: the next check() tries again while attempts remain
            await self._joined(name, url, restarted=True)
        except Exception:  # noqa: BLE001 - a failed restart leaves the instance failed; the run goes on
            log.exception("restarting %s failed", name)
        finally:
            self._restarting.pop(name, None)

    async def _joined(self, name: str, url: str, *, restarted: bool) -> None:
        """``name`` serves at ``url``: it (re)joins the pool under a new client."""
        old_engine = self.runtime.engines.get(name)
        self.runtime.add_instance(name, self.make_engine(url))
        if restarted:
            self.runtime.pool.engine_restarts = (self.runtime.pool.engine_restarts or 0) + 1
        if old_engine is not None and hasattr(old_engine, "close"):
            try:
                await old_engine.close()
            except Exception:  # noqa: BLE001 - best effort: it pointed at a dead process
                pass
        if restarted and self.on_restarted is not None:
            self.on_restarted()

    async def _healthy(self, url: str, child) -> bool:
        """Whether ``child`` (None: an instance of another node) serves ``health_path`` before ``startup_timeout_s`` (False: it
        exited or timed out; the caller logs it and retries while attempts remain)."""
        try:
            await wait_ready(url, path=self.policy.health_path, timeout_s=self.policy.startup_timeout_s,
                             interval_s=0.25, alive=child.alive if child is not None else None)
        except InstanceNotReady:
            return False
        return True
