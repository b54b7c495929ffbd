"""One node's part of a SLURM job: start this node's processes, run the controller on the first node.

WHY every node runs the same command: ``srun dora train`` starts one task per node; each task
reads the same config and SLURM environment, computes the same :class:`ClusterPlan` and starts only
the processes placed on its node (torchrun, rollout instances), logging to
``<run_dir>/logs/<node>/``. The first node also runs the controller in-process; at the end it
writes ``<run_dir>/DONE`` (or ``FAILED``), which tells every other node to stop its processes and
exit.

Ports: a port the config does not fix is picked on the node that starts the process, free there
(``launch.port_range``), and published in ``<run_dir>/addresses/`` (:mod:`.addresses`); the other
trainer nodes and the controller read it there.

Faults: a rollout instance that dies is restarted by its own node's launcher, on a fresh free port
(the same one when ``cluster.rollout_base_port`` fixes it), at most ``launch.max_engine_restarts``
times (``launch.restart_engines``); on a node other than the controller's it publishes the new
address and asks to rejoin through the join folder. One that could not bind its port is reported
as such, naming the process that holds it. A lost trainer is restarted inside the
job (:mod:`.trainer_restart`, ``launch.max_trainer_restarts``): the controller's node restarts its
torchrun and asks other trainer nodes to restart theirs from the same checkpoint; a trainer node
whose part died tells the controller (the ranks left would wait for it in a collective). A node exits
non-zero only when the run fails (FAILED, or its trainer died with no restart left), so
``srun --kill-on-bad-exit`` ends the job for run failures only. Every way a job ends leaves a marker: the first SIGTERM (``scancel``, the time limit),
SIGINT or SIGUSR1 (the templates' early warning before the time limit) stops the run at its next
step boundary with a checkpoint (:mod:`.stop`) and writes FAILED saying so; a second one writes
FAILED with the reason at once, before the processes stop. Markers name the job that wrote them, so the
nodes of a resumed job are not stopped by the FAILED of the job they resume.

``--join`` (elastic pools): the allocation's nodes start rollout instances only and, once each is
ready, write a join request into the running job's join folder (:mod:`.elastic`). A joiner waits at
most ``cluster.join_timeout_s`` for the controller's heartbeat, so one pointed at a dead run exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dora_megatron.comm import auth
from dora_megatron.config.loader import dump_yaml
from dora_megatron.config.schema import DoraConfig
from dora_megatron.launch.addresses import PICK_HOST, Address, PortPicker, read as read_address, url_resolver
from dora_megatron.launch.addresses import publish as publish_address
from dora_megatron.ports import PortInUse, check_bindable, collision_message, job_port_range, port_holders
from dora_megatron.launch.cluster import ClusterPlan
from dora_megatron.launch.process_launcher import ProcessLauncher
from dora_megatron.processes import ChildFailed, ProcessSet
from dora_megatron.launch.slurm import SlurmEnv, slurm_run_dir
from dora_megatron.launch.startup import StartupRefused
from dora_megatron.launch.stop import StopSignals, Stopped, exit_status
from dora_megatron.launch.trainer_restart import (PartLost, RestartRequest, TrainerLost, TrainerRestarts,
                                                  report_part_lost, request_restart, restart_requested, restart_trainer,
                                                  run_restarting, trainer_argv, wait_part_lost, watch_trainer_parts)

log = logging.getLogger(__name__)

DONE, FAILED = "DONE", "FAILED"


def _say(msg: str) -> None:
    log.info(msg)
    sys.stderr.write(msg + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Marker:
    kind: str  # DONE | FAILED
    reason: str
    job_id: str
    #: provisional: the controller's node is stopping the run at its next step boundary (a stop
    #: signal came); the final marker replaces it. The other nodes keep their processes up meanwhile
    stopping: bool = False


def read_marker(run_dir: Path) -> Marker | None:
    for kind in (DONE, FAILED):
        try:
            lines = (run_dir / kind).read_text().splitlines()
        except OSError:
            continue
        job = next((x[4:] for x in lines if x.startswith("job ")), "")
        return Marker(kind, lines[0] if lines else "", job, "stopping" in lines[1:])
    return None


def write_marker(run_dir: Path, kind: str, reason: str, job_id: str, *, stopping: bool = False) -> bool:
    """Write DONE or FAILED unless this job already ended (the first reason is kept; a provisional
    ``stopping`` FAILED of this job is replaced by the final one). Returns whether it was written."""
    current = read_marker(run_dir)
    if current is not None and current.job_id == job_id and not (current.stopping and not stopping):
        return False
    tmp = run_dir / f".{kind}.{os.getpid()}.tmp"
    tmp.write_text(f"{reason}\njob {job_id}\n" + ("stopping\n" if stopping else ""))
    try:
        if current is not None and current.job_id == job_id:  # the provisional marker: replaced whole
            (run_dir / current.kind).unlink(missing_ok=True)
        os.link(tmp, run_dir / kind)  # fails if another node wrote it first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _clear_previous_markers(run_dir: Path, job_id: str) -> None:
    """A resumed run: the marker of the job it resumes (FAILED, or DONE when a finished run is extended
    with ``--set run.steps=N``) is kept as ``<KIND>.job<id>``, so this job can write its own."""
    m = read_marker(run_dir)
    if m is not None and m.job_id != job_id:
        os.replace(run_dir / m.kind, run_dir / f"{m.kind}.job{m.job_id or 'unknown'}")


class _EndSignals(StopSignals):
    """While active, SIGINT, SIGTERM and SIGUSR1 (SLURM's early warning) end the job.

    On the controller's node the first one, once the runtime runs, asks it for a checkpoint at the
    next step boundary (:mod:`.stop`); the run then ends with FAILED naming the signal and the
    checkpoint. On the other nodes the first one is noted and the node keeps its processes up
    (``hold``) until the controller's marker ends the job: the trainer and the instances are what
    that checkpoint needs (``scancel`` and SLURM's time limit signal every node at once). A second
    signal, or a first one before the runtime runs, writes FAILED (with the signal and node) and
    unwinds at once; ``mark=False`` (joining nodes: their end is not the run's) only unwinds.

    WHY write in the handler: ``scancel`` and the time limit give the job only ``KillWait`` seconds
    before SIGKILL; the marker must be on disk before anything else is attempted."""

    def __init__(self, run_dir: Path, job_id: str, node: str, *, mark: bool = True, hold: bool = False) -> None:
        super().__init__(on_immediate=self._mark)
        self.run_dir, self.job_id, self.node, self.mark = run_dir, job_id, node, mark
        if hold:
            super().arm(lambda name: True)

    def arm(self, target) -> None:
        """The controller's node: a stop request also writes a provisional FAILED at once (if SLURM's
        SIGKILL comes before the checkpoint, the job still ends with a marker); the other nodes go on
        serving while it says ``stopping``."""
        def marked(name: str) -> bool:
            taken = target(name)
            if taken and self.mark:
                write_marker(self.run_dir, FAILED, f"{self.reason(name)}: stopping at the next step boundary "
                             f"with a checkpoint", self.job_id, stopping=True)
            return taken
        super().arm(marked)

    def reason(self, name: str) -> str:
        why = {"SIGTERM": "scancel or time limit", "SIGUSR1": "time limit soon"}.get(name, "interrupted")
        return f"terminated by {name} on {self.node} ({why})"

    def _mark(self, name: str) -> None:
        if self.mark:
            write_marker(self.run_dir, FAILED, self.reason(name), self.job_id)


def _join_dir(cfg: DoraConfig, run_dir: Path) -> Path:
    return Path(cfg.cluster.join_dir) if cfg.cluster.join_dir else run_dir / "join"


def _healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


class NodeEngines:
    """A node's rollout instances outside the controller's process: restart one that died on its
    port and ask the controller to take it back (a join request with the next ``attempt``).

    ``announce_first``: joining nodes announce every instance once it is first ready, too.
    ``run_dir`` (vLLM): the controller's requests to restart an instance on a new snapshot (the
    MoE-on-CPU version switch) are carried out here, in the same loop."""

    def __init__(self, cfg: DoraConfig, procs: ProcessSet, plan: ClusterPlan, node: str, join_dir: Path, *,
                 announce_first: bool, run_dir: Path | None = None, job_id: str | None = None,
                 picker: PortPicker | None = None) -> None:
        self.cfg, self.procs, self.plan, self.node, self.join_dir = cfg, procs, plan, node, join_dir
        self.specs = {p.name: p for p in plan.processes_on(node) if p.role == "engine" and p.name in plan.engine_urls}
        self.names = set(self.specs)
        self.picker = picker
        #: each instance's URL now (its published port when picked here; it changes at a restart)
        self.urls = {n: self._published_url(n) for n in self.names}
        # this node's part of a trainer that spans nodes: restarted when the controller asks (run_dir, job_id)
        self.trainers = {p.name for p in plan.processes_on(node) if p.role == "trainer"}
        self.run_dir, self.job_id = run_dir, job_id
        self.trainer_restarts = 0  # the controller's restart requests carried out
        self.trainer_waiting: set[str] = set()
        self.health = {"embedded": "/health", "vllm": cfg.vllm.health_path}.get(cfg.rollout.engine, cfg.sglang.health_path)
        self.switches = None
        if cfg.rollout.engine == "vllm" and run_dir is not None:
            from dora_megatron.rollout.vllm.switch import RestartRequests, pin_root_of, restart_dir

            self.switches = RestartRequests(procs, restart_dir(run_dir), pin_root_of(procs))
        self.attempts = {n: 0 for n in self.names}
        self.restarted_at: dict[str, float] = {}  # wall time of each instance's last restart (join requests carry it)
        self.pending = {n: time.monotonic() + cfg.rollout.startup_timeout_s for n in self.names} if announce_first else {}
        self.given_up: set[str] = set()

    def check(self) -> None:
        from dora_megatron.launch.elastic import JoinRequest, write_join_request

        if self.switches is not None:
            for name in self.switches.serve():
                _say(f"{name} on {self.node} restarted on a new snapshot (vLLM version switch, asked by the controller)")
        for child in list(self.procs.children):
            name = child.name
            if name in self.given_up:
                continue
            if name not in self.names:  # a trainer (or part of a multi-node instance): the run cannot go on
                if name in self.trainers and self._trainer_restart(child):
                    continue
                # status 0: the trainer was told to stop at the end of the run (DONE follows)
                if not child.alive() and child.popen.returncode != 0:
                    raise ChildFailed(child.failure())
                continue
            late = name in self.pending and time.monotonic() > self.pending[name]
            if child.alive() and not late:
                if name in self.pending and _healthy(self.urls[name] + self.health):
                    del self.pending[name]
                    write_join_request(self.join_dir, JoinRequest(name, self.urls[name],
                                                                  self.plan.engine_gpus[name], self.attempts[name],
                                                                  self.restarted_at.get(name)))
                    _say(f"{name} on {self.node} ready at {self.urls[name]}: join requested "
                         f"(attempt {self.attempts[name]})")
                continue
            why = f"exited with status {child.popen.returncode}" if not child.alive() else "never became healthy"
            collision = self._collision(name, child) if not child.alive() else None
            if collision:
                why = f"exited with status {child.popen.returncode}: {collision}"
            final = not self.cfg.launch.restart_engines or self.attempts[name] >= self.cfg.launch.max_engine_restarts
            self._publish_failure(name, why, final=final)
            if final:
                self.given_up.add(name)
                self.pending.pop(name, None)
                self.procs.stop(child)
                _say(f"{name} on {self.node} {why}; no restart left (launch.max_engine_restarts="
                     f"{self.cfg.launch.max_engine_restarts}): the node stays up, the run goes on without it")
                continue
            self.attempts[name] += 1
            argv = self._new_ports(name)
            _say(f"{name} on {self.node} {why}: restarting it (attempt {self.attempts[name]} of "
                 f"{self.cfg.launch.max_engine_restarts}){' at ' + self.urls[name] if argv else ''}, log {child.log_path}")
            self.procs.restart(name, argv)
            self.restarted_at[name] = time.time()
            self.pending[name] = time.monotonic() + self.cfg.rollout.startup_timeout_s


    def _published_url(self, name: str) -> str:
        template = self.plan.engine_urls[name]
        if self.picker is None:
            return template
        url, _ = url_resolver(self.picker.run_dir, self.picker.job)(template)
        return url or template

    def _port_now(self, name: str) -> int | None:
        spec = self.specs[name]
        if spec.port is not None:
            return spec.port
        addr = read_address(self.picker.run_dir, name, self.picker.job) if self.picker is not None else None
        return addr.port if addr is not None else None

    def _collision(self, name: str, child) -> str | None:
        """Why ``child`` could not serve when another process holds its port (None: nobody else does)."""
        port = self._port_now(name)
        if port is None:
            return None
        mine = {c.popen.pid for c in self.procs.children if c.alive()}
        if not [h for h in port_holders(port) if h.pid not in mine]:
            return None
        return collision_message(self.node, PICK_HOST, port, name)

    def _publish_failure(self, name: str, why: str, *, final: bool) -> None:
        port = self._port_now(name)
        if self.picker is not None and port is not None:
            self.picker.failed(name, port, why, final=final)

    def _new_ports(self, name: str) -> list[str] | None:
        """The restart's command line with fresh ports (published; the old one may be what failed),
        or None: the same command line (fixed ports)."""
        spec = self.specs[name]
        if not spec.auto_ports or self.picker is None:
            return None
        old = self._port_now(name)
        argv, _ = self.picker.resolve(spec.argv, spec.auto_ports, avoid=[old] if old else [])
        self.urls[name] = self._published_url(name)
        return argv

    def _trainer_restart(self, child) -> bool:
        """This node's torchrun of a trainer spanning nodes: restart it when the controller asks
        (:func:`~.trainer_restart.request_restart`, from the checkpoint the controller chose). One
        that died while the job has trainer restarts left waits for that request (the controller
        notices the loss within ``controller.trainer_timeout_s``, or ends the run with FAILED).
        False: nothing to do here (alive, or no restart left: the caller fails the node)."""
        if self.run_dir is None or self.job_id is None:
            return False
        req = restart_requested(self.run_dir, self.job_id, self.trainer_restarts)
        if req is not None:
            self.trainer_restarts = req.number
            self.trainer_waiting.discard(child.name)
            where = f"checkpoint {req.checkpoint.name}" if req.checkpoint is not None else "the initial weights"
            _say(f"{child.name} on {self.node}: restarting it from {where} (trainer restart {req.number}, "
                 f"asked by the controller)")
            self.procs.restart(child.name, trainer_argv(child.argv, req.checkpoint))
            return True
        if child.alive() or child.popen.returncode == 0 or self.trainer_restarts >= self.cfg.launch.max_trainer_restarts:
            return False
        if child.name not in self.trainer_waiting:
            self.trainer_waiting.add(child.name)
            # the ranks on the other nodes wait for this one inside a collective: tell the controller
            report_part_lost(self.run_dir, PartLost(self.job_id, self.trainer_restarts, self.node,
                                                    child.failure().splitlines()[0]))
            _say(f"{child.name} on {self.node} exited with status {child.popen.returncode}: the controller was "
                 f"told; waiting for it to restart the trainer (launch.max_trainer_restarts="
                 f"{self.cfg.launch.max_trainer_restarts}, {self.trainer_restarts} used)")
        return True


def _serve_until_end(run_dir: Path, engines: NodeEngines, job_id: str | None, poll_s: float = 1.0,
                     alive_bound_s: float | None = None, stopping_bound_s: float | None = None) -> int:
    """Keep this node's processes up until the run ends.

    ``job_id``: markers of that job end the wait (None: any marker, for joining nodes).
    ``alive_bound_s``: joining nodes also stop when the controller's heartbeat is older than this.
    ``stopping_bound_s``: a provisional ``stopping`` marker (the controller checkpoints before it
    ends the run: it needs this node's trainer and instances) is waited out at most this long."""
    from dora_megatron.launch.elastic import heartbeat_age

    stopping_since = None
    while True:
        m = read_marker(run_dir)
        if m is not None and m.stopping and stopping_bound_s is not None and m.job_id == job_id:
            stopping_since = stopping_since or time.monotonic()
            if time.monotonic() - stopping_since < stopping_bound_s:
                engines.check()
                time.sleep(poll_s)
                continue
        if m is not None and (job_id is None or m.job_id == job_id):
            _say(f"run ended: {m.kind} ({m.reason})")
            return 0 if m.kind == DONE else 1
        if alive_bound_s is not None:
            age = heartbeat_age(engines.join_dir)
            if age is not None and age > alive_bound_s:
                _say(f"the controller of {run_dir} stopped ({age:.0f} s without a heartbeat, no DONE/FAILED): "
                     f"stopping this node's instances")
                return 1
        engines.check()
        time.sleep(poll_s)


def _shared_model(cfg: DoraConfig, plan: ClusterPlan, run_dir: Path, node: str) -> Path:
    """The model of version 0: ``model.path``, else made once by the controller's node in
    ``<run_dir>/model`` (the shared filesystem) while the other nodes wait for it (bounded)."""
    from dora_megatron.launch.local import prepare_model

    if cfg.model.path:
        return Path(cfg.model.path)
    ready = run_dir / "model" / ".ready"
    if node == plan.controller_node:
        path = prepare_model(cfg, run_dir, say=_say)
        ready.write_text("ok\n")
        return path
    bound = cfg.launch.trainer_startup_timeout_s
    deadline = time.monotonic() + bound
    while not ready.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no model in {ready.parent} after {bound:.0f} s (launch.trainer_startup_timeout_s): "
                               f"the controller's node {plan.controller_node} did not prepare it")
        time.sleep(0.5)
    return ready.parent


def run_slurm_node(cfg: DoraConfig, env: SlurmEnv, plan: ClusterPlan, resume: str | None = None) -> int:
    from dora_megatron.launch.inputs import input_problem
    from dora_megatron.launch.local import resume_checkpoint
    from dora_megatron.rollout.sglang.server import start_instance

    node = env.this_node
    if node is None:
        _say("dora train (slurm): SLURM_NODEID/SLURMD_NODENAME not set: run through srun, or use --dry-run")
        return 2
    problem = input_problem(cfg)
    if problem:
        _say(f"dora train (slurm): {problem}")
        return 2
    run_dir = Path(resume or slurm_run_dir(cfg, env)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    is_controller = node == plan.controller_node
    if is_controller and resume:
        _clear_previous_markers(run_dir, env.job_id)
    _write_atomic(run_dir / "config.yaml", dump_yaml(cfg))  # same text on every node
    join_dir = _join_dir(cfg, run_dir)
    try:
        with auth.job_environment(run_dir, cfg.launch.secret_file), \
                _EndSignals(run_dir, env.job_id, node, hold=not is_controller) as signals:
            model_dir = _shared_model(cfg, plan, run_dir, node)
            checkpoint = None
            if resume:  # every node verifies the same files and picks the same one; none moves anything
                checkpoint, error = resume_checkpoint(run_dir, _say, quarantine=False)
                if checkpoint is None:
                    _say(error)
                    return 2
            mine = plan.processes_on(node)
            _say(f"node {node} ({plan.roles[node]}): {len(mine)} process(es), run directory {run_dir}")
            picker = PortPicker(run_dir, env.job_id, node, job_port_range(cfg.launch.port_range),
                                wait_s=cfg.launch.trainer_startup_timeout_s)
            with ProcessSet(run_dir / "logs" / node, grace_s=cfg.launch.shutdown_timeout_s) as procs:
                for spec in mine:
                    if spec.role == "trainer":
                        for what, port in spec.extra_ports.items():  # fixed ones: a holder is named now
                            check_bindable(node, PICK_HOST, port, f"{spec.name}'s {what} (cluster.*_port)")
                        argv, _ = picker.resolve(spec.argv, spec.auto_ports)
                        argv += ["--resume", str(checkpoint / "trainer")] if checkpoint else []
                        # the controller's child watcher knows the trainer by this name
                        procs.start("trainer" if is_controller else spec.name, argv, {**spec.env, "PYTHONUNBUFFERED": "1"})
                    elif spec.role == "engine":
                        argv, _ = picker.resolve(spec.argv, spec.auto_ports)
                        start_instance(procs, dataclasses.replace(spec, argv=tuple(argv)), cfg.rollout.engine)
                if not is_controller:  # a ChildFailed (its trainer died) writes FAILED below
                    return _serve_until_end(run_dir, NodeEngines(cfg, procs, plan, node, join_dir, announce_first=False,
                                                                 run_dir=run_dir, job_id=env.job_id, picker=picker),
                                            env.job_id,
                                            stopping_bound_s=cfg.controller.stop_checkpoint_timeout_s
                                            + 2 * cfg.launch.shutdown_timeout_s)
                budget = TrainerRestarts(cfg.launch.max_trainer_restarts)

                def run_once(ck: Path | None) -> dict:
                    try:
                        return asyncio.run(_controller(cfg, plan, run_dir, model_dir, procs, ck, node, signals,
                                                       trainer_restarts=budget.used, job_id=env.job_id))
                    except TrainerLost as err:
                        if signals.received is None:
                            raise
                        # scancel and the time limit signal every process of the step: a trainer ended by
                        # that signal is the job ending, not a loss to restart (handled below)
                        raise ChildFailed(str(err)) from err

                try:
                    summary = run_restarting(
                        run_once, lambda err: _restart_trainer(cfg, plan, procs, run_dir, model_dir, err, budget,
                                                               env.job_id),
                        checkpoint, budget)
                except Stopped:
                    raise
                except ChildFailed as err:
                    if signals.received is None:
                        write_marker(run_dir, FAILED, f"controller failed: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0] if str(err) else ''}", env.job_id)
                        raise
                    # scancel and the time limit signal every process of the step, the trainer too: when
                    # it dies of that signal before the step boundary, no checkpoint can be written; the
                    # job ended because of the signal, and a resume goes on from the last complete one
                    line = (f"a process ended by the same signal before the step boundary "
                            f"({str(err).splitlines()[0] if str(err) else 'child failed'}); no new checkpoint; "
                            f"`dora train --resume {run_dir}` continues from the last complete checkpoint")
                    write_marker(run_dir, FAILED, f"{signals.reason(signals.received)}: {line}", env.job_id)
                    _say(f"dora train on {node}: {signals.reason(signals.received)}: {line}")
                    return exit_status(signals.received)
                except BaseException as err:
                    write_marker(run_dir, FAILED, f"controller failed: {type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}", env.job_id)
                    raise
                if cfg.observability.overview:
                    from dora_megatron.launch.local import _write_overview

                    _write_overview(run_dir, cfg.orchestrator.mode, _say)
                if summary["status"] != "completed":
                    from dora_megatron.launch.local import stopped_line

                    line = stopped_line(summary, run_dir)
                    write_marker(run_dir, FAILED, f"{signals.reason(summary['stopped_by'])}: {line}", env.job_id)
                    _say(f"dora train on {node}: {line}")
                    return exit_status(summary["stopped_by"])
                write_marker(run_dir, DONE, "ok", env.job_id)
                return 0
    except ChildFailed as err:
        write_marker(run_dir, FAILED, f"a process on {node} failed: {str(err).splitlines()[0]}", env.job_id)
        _say(f"a process on {node} failed: {err}")
        return 1
    except (TimeoutError, ValueError, StartupRefused, PortInUse) as err:  # too few instances ready, no model, a held port
        write_marker(run_dir, FAILED, f"dora train failed on {node}: {str(err).splitlines()[0]}", env.job_id)
        _say(f"dora train failed on {node}: {err}")
        return 1
    except Stopped as sig:
        _say(f"dora train on {node}: terminated by {sig.signame}; FAILED written, every process was stopped")
        return exit_status(sig.signame)


def _restart_trainer(cfg: DoraConfig, plan: ClusterPlan, procs: ProcessSet, run_dir: Path, model_dir: Path,
                     err: TrainerLost, budget: TrainerRestarts, job_id: str) -> Path | None:
    """The controller's node brings back a lost trainer (:mod:`.trainer_restart`): its own torchrun is
    restarted from the chosen checkpoint; when the trainer spans other nodes, each of them is first
    asked to restart its torchrun from the same one (:meth:`NodeEngines.check` carries it out)."""
    def ask_other_nodes(checkpoint: Path | None) -> None:
        if any(p.role == "trainer" and p.host != plan.controller_node for p in plan.processes):
            request_restart(run_dir, RestartRequest(job_id, budget.used, checkpoint))

    resolve = url_resolver(run_dir, job_id)  # where the instances are now (published by their nodes)
    urls = {n: resolve(t)[0] or t for n, t in plan.engine_urls.items()}
    return restart_trainer(cfg, procs, urls, run_dir, model_dir, err, budget, _say,
                           before_start=ask_other_nodes)


async def _controller(cfg: DoraConfig, plan: ClusterPlan, run_dir: Path, model_dir: Path, procs: ProcessSet,
                      checkpoint, node: str, signals: StopSignals | None = None, trainer_restarts: int = 0,
                      job_id: str | None = None) -> dict:
    from dora_megatron.controller.main import Endpoints, run_controller

    join_dir = _join_dir(cfg, run_dir)
    join_dir.mkdir(parents=True, exist_ok=True)
    spans = any(p.role == "trainer" and p.host != plan.controller_node for p in plan.processes)
    # ``node``: instances on this node are restarted by the controller's own supervisor at their URL
    launcher = JoiningLauncher(cfg, procs, run_dir, model_dir, node, join_dir,
                               trainer_lineage=(job_id, trainer_restarts) if spans and job_id is not None else None,
                               published=(job_id, set(plan.engine_urls)) if job_id is not None else None)
    resolve = url_resolver(run_dir, job_id or "")
    launcher.locate = lambda name: _locate(resolve, plan.engine_urls[name])
    # this node's own ports are published already; other nodes' are followed while the job starts
    urls = {n: resolve(t)[0] or t for n, t in plan.engine_urls.items()}
    trainer_url, _ = resolve(plan.trainer_url)
    return await run_controller(cfg, Endpoints(urls, trainer_url or plan.trainer_url), run_dir, model_dir,
                                launcher, _say, checkpoint, stop_signals=signals, trainer_restarts=trainer_restarts)


def _locate(resolve, template: str) -> tuple[str | None, str, bool]:
    """(url now, why it is down, whether for good) of an instance from its node's published record."""
    url, addr = resolve(template)
    return url, addr.failed if addr is not None else "", addr.final if addr is not None else False


class JoiningLauncher(ProcessLauncher):
    """The controller node's launcher: its event sources add the elastic join watcher (the
    instances of join nodes announce themselves in ``join_dir``, ``cluster.join_dir``) and, for a
    trainer spanning nodes (``trainer_lineage``: this job's id and its trainer restarts so far), the
    watch for the other trainer nodes' notices that their part died (:func:`.watch_trainer_parts`)."""

    #: how long an error answered by a trainer spanning nodes waits for a trainer node's notice
    #: that its part died (that node polls every second; its torchrun first notices its rank's death)
    PART_NOTICE_WAIT_S = 30.0

    def __init__(self, cfg: DoraConfig, procs: ProcessSet, run_dir: Path, model_dir: Path, node: str,
                 join_dir: Path, trainer_lineage: tuple[str, int] | None = None,
                 published: tuple[str, set[str]] | None = None) -> None:
        super().__init__(cfg, procs, run_dir, host=node, fixed_ports=bool(cfg.cluster.rollout_base_port))
        self.model_dir, self.join_dir, self.trainer_lineage = model_dir, join_dir, trainer_lineage
        self.node, self.published = node, published

    def _restarted(self) -> None:
        """An instance on this node came back (on a fresh port unless fixed): its record follows it
        (``published``: this job's id and its instances' names)."""
        super()._restarted()
        if self.published is None:
            return
        job, names = self.published
        for c in self.procs.children:
            if c.name in names and "--port" in c.argv:
                publish_address(self.run_dir, Address(c.name, self.node, int(c.argv[c.argv.index("--port") + 1]), job))

    async def trainer_failure(self, err: Exception, answered: str | None) -> BaseException:
        """A trainer spanning nodes whose part on another node died: rank 0 fails the step's collective
        and answers that error (or the call drops); the part's node reports the death, which makes
        it a lost trainer (restarted), not an error a restart would repeat."""
        if self.trainer_lineage is not None:
            lost = await wait_part_lost(self.run_dir, *self.trainer_lineage, self.PART_NOTICE_WAIT_S)
            if lost is not None:
                return lost
        return await super().trainer_failure(err, answered)

    def _make_joined(self, req):  # a joining instance gets the same client as the planned ones
        from dora_megatron.rollout.factory import engine_for

        return engine_for(self.cfg, req.url, str(self.model_dir), run_dir=self.run_dir)

    def event_sources(self, runtime, make_engine, started) -> list:
        from dora_megatron.launch.elastic import watch_joins

        # asked once the start-up wait is over: from now on the controller sends work
        sources = [*super().event_sources(runtime, make_engine, started),
                   watch_joins(self.join_dir, runtime, self._make_joined, poll_s=self.cfg.cluster.join_poll_s,
                               started_at=time.time())]
        if self.trainer_lineage is not None:
            sources.append(watch_trainer_parts(self.run_dir, *self.trainer_lineage, runtime.tasks.stop))
        return sources


def run_join_node(cfg: DoraConfig, env: SlurmEnv, plan: ClusterPlan) -> int:
    """Start this node's joining instances, announce each once ready, serve until the run ends.

    Bounded: a run that has ended (DONE/FAILED) and shows no live controller is refused at once; a
    run whose controller gives no heartbeat for ``cluster.join_timeout_s`` is left with a message."""
    from dora_megatron.launch.elastic import heartbeat_age
    from dora_megatron.rollout.sglang.server import start_instance

    node = env.this_node
    if node is None or not cfg.run.run_dir:
        _say("dora train --join: run through srun with run.run_dir set to the running job's directory")
        return 2
    run_dir = Path(cfg.run.run_dir)
    if not (run_dir / "config.yaml").is_file():
        _say(f"dora train --join: {run_dir} is not a run directory (no config.yaml)")
        return 2
    join_dir, bound = _join_dir(cfg, run_dir), cfg.cluster.join_timeout_s
    m, age = read_marker(run_dir), heartbeat_age(join_dir)
    if m is not None and (age is None or age > 3 * cfg.cluster.join_poll_s):
        _say(f"dora train --join: the run in {run_dir} has ended ({m.kind}: {m.reason}); nothing to join")
        return 1
    deadline = time.monotonic() + bound
    try:
        with auth.job_environment(run_dir, cfg.launch.secret_file), _EndSignals(run_dir, env.job_id, node, mark=False), \
                ProcessSet(run_dir / "logs" / f"join-{env.job_id}-{node}", grace_s=cfg.launch.shutdown_timeout_s) as procs:
            picker = PortPicker(run_dir, env.job_id, node, job_port_range(cfg.launch.port_range),
                                wait_s=cfg.launch.trainer_startup_timeout_s)
            for spec in plan.processes_on(node):
                if spec.role == "engine":
                    argv, _ = picker.resolve(spec.argv, spec.auto_ports)
                    start_instance(procs, dataclasses.replace(spec, argv=tuple(argv)), cfg.rollout.engine)
            engines = NodeEngines(cfg, procs, plan, node, join_dir, announce_first=True, run_dir=run_dir, picker=picker)
            while (heartbeat_age(join_dir) or float("inf")) > bound:  # no live controller yet
                if time.monotonic() > deadline:
                    _say(f"dora train --join: no live controller in {run_dir} after {bound:.0f} s "
                         f"(cluster.join_timeout_s; heartbeat {join_dir / 'controller.alive'} "
                         f"{'missing' if heartbeat_age(join_dir) is None else 'too old'}): giving up")
                    return 1
                engines.check()
                time.sleep(1.0)
            return _serve_until_end(run_dir, engines, None, alive_bound_s=bound)
    except ChildFailed as err:
        _say(f"joining instance on {node} failed: {err}")
        return 1
    except Stopped as sig:
        _say(f"dora train --join on {node}: terminated by {sig.signame}; every process was stopped")
        return exit_status(sig.signame)
