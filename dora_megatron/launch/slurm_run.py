"""One node's part of a SLURM job: start this node's processes, run the controller on the first node.

WHY every node runs the same command: ``srun dora train`` starts one task per node; each task
reads the same config and SLURM environment, computes the same :class:`ClusterPlan` and starts only
the processes placed on its node (torchrun, SGLang instances), logging to
``<run_dir>/logs/<node>/``. The first node also runs the controller in-process; at the end it
writes ``<run_dir>/DONE`` (or ``FAILED``), which tells every other node to stop its processes and
exit. A node whose process dies exits non-zero, which (``srun --kill-on-bad-exit``) ends the job.

``--join`` (elastic pools): the allocation's nodes start SGLang instances only and, once each is
ready, write a join request into the running job's join folder (:mod:`.elastic`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from dora_megatron.config.loader import dump_yaml
from dora_megatron.config.schema import DoraConfig
from dora_megatron.launch.cluster import ClusterPlan
from dora_megatron.launch.processes import ChildFailed, ProcessSet
from dora_megatron.launch.slurm import SlurmEnv, slurm_run_dir

log = logging.getLogger(__name__)

DONE, FAILED = "DONE", "FAILED"


def _say(msg: str) -> None:
    log.info(msg)
    sys.stderr.write(msg + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _join_dir(cfg: DoraConfig, run_dir: Path) -> Path:
    return Path(cfg.cluster.join_dir) if cfg.cluster.join_dir else run_dir / "join"


def _wait_end(run_dir: Path, procs: ProcessSet, poll_s: float = 5.0) -> int:
    """Non-controller nodes: keep the processes up until the controller ends the job."""
    while True:
        if (run_dir / DONE).exists():
            return 0
        if (run_dir / FAILED).exists():
            return 1
        procs.check_alive()
        time.sleep(poll_s)


def run_slurm_node(cfg: DoraConfig, env: SlurmEnv, plan: ClusterPlan, resume: str | None = None) -> int:
    from dora_megatron.launch.inputs import input_problem
    from dora_megatron.launch.local import prepare_model, resume_checkpoint
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
    _write_atomic(run_dir / "config.yaml", dump_yaml(cfg))  # same text on every node
    if cfg.model.path:
        model_dir = Path(cfg.model.path)
    elif len(plan.nodes) == 1:
        model_dir = prepare_model(cfg, run_dir, say=_say)
    else:
        _say("dora train (slurm): multi-node jobs need model.path (a HF directory on a shared filesystem)")
        return 2
    checkpoint = None
    if resume:  # every node verifies the same files and picks the same one; none moves anything
        checkpoint, error = resume_checkpoint(run_dir, _say, quarantine=False)
        if checkpoint is None:
            _say(error)
            return 2
    is_controller = node == plan.controller_node
    mine = plan.processes_on(node)
    _say(f"node {node} ({plan.roles[node]}): {len(mine)} process(es), run directory {run_dir}")
    try:
        with ProcessSet(run_dir / "logs" / node, grace_s=cfg.launch.shutdown_timeout_s) as procs:
            for spec in mine:
                if spec.role == "trainer":
                    argv = list(spec.argv) + (["--resume", str(checkpoint / "trainer")] if checkpoint else [])
                    # the controller's child watcher knows the trainer by this name
                    procs.start("trainer" if is_controller else spec.name, argv, {**spec.env, "PYTHONUNBUFFERED": "1"})
                elif spec.role == "engine":
                    start_instance(procs, spec)
            if not is_controller:
                return _wait_end(run_dir, procs)
            try:
                asyncio.run(_controller(cfg, plan, run_dir, model_dir, procs, checkpoint))
            except BaseException:
                _write_atomic(run_dir / FAILED, "controller failed\n")
                raise
            _write_atomic(run_dir / DONE, "ok\n")
            return 0
    except ChildFailed as err:
        _say(f"a process on {node} failed: {err}")
        return 1
    except (TimeoutError, ValueError) as err:  # e.g. an instance never became healthy (FAILED was written)
        _say(f"dora train failed on {node}: {err}")
        return 1


async def _controller(cfg: DoraConfig, plan: ClusterPlan, run_dir: Path, model_dir: Path, procs: ProcessSet,
                      checkpoint) -> dict:
    from dora_megatron.launch.elastic import watch_joins
    from dora_megatron.launch.local import _run_controller
    from dora_megatron.rollout.sglang.client import SGLangClient
    from dora_megatron.rollout.sglang.engine import SGLangEngine

    join_dir = _join_dir(cfg, run_dir)
    join_dir.mkdir(parents=True, exist_ok=True)

    def start_watcher(runtime) -> None:
        make = lambda req: SGLangEngine(SGLangClient(req.url, timeout_s=cfg.rollout.request_timeout_s),  # noqa: E731
                                        checksum=not cfg.sglang.enable_eplb)
        asyncio.get_running_loop().create_task(watch_joins(join_dir, runtime, make, poll_s=cfg.cluster.join_poll_s))

    return await _run_controller(cfg, run_dir, model_dir, "", [], 0, procs, _say, checkpoint,
                                 engine_urls=plan.engine_urls, trainer_url=plan.trainer_url, on_runtime=start_watcher)


def run_join_node(cfg: DoraConfig, env: SlurmEnv, plan: ClusterPlan) -> int:
    """Start this node's joining instances, announce each once ready, serve until the job ends."""
    from dora_megatron.launch.elastic import JoinRequest, write_join_request
    from dora_megatron.rollout.sglang.server import start_instance, wait_ready

    node = env.this_node
    if node is None or not cfg.run.run_dir:
        _say("dora train --join: run through srun with run.run_dir set to the running job's directory")
        return 2
    run_dir = Path(cfg.run.run_dir)
    if not (run_dir / "config.yaml").is_file():
        _say(f"dora train --join: {run_dir} is not a run directory (no config.yaml)")
        return 2
    mine = [p for p in plan.processes_on(node) if p.role == "engine"]
    try:
        with ProcessSet(run_dir / "logs" / f"join-{env.job_id}-{node}", grace_s=cfg.launch.shutdown_timeout_s) as procs:
            children = {spec.name: start_instance(procs, spec) for spec in mine}

            async def announce() -> None:
                async def one(spec) -> None:
                    child = children[spec.name]
                    await wait_ready(plan.engine_urls[spec.name], path=cfg.sglang.health_path,
                                     timeout_s=cfg.rollout.startup_timeout_s, alive=child.alive, tail=child.tail)
                    write_join_request(_join_dir(cfg, run_dir), JoinRequest(spec.name, plan.engine_urls[spec.name],
                                                                            plan.engine_gpus[spec.name]))
                    _say(f"{spec.name} ready at {plan.engine_urls[spec.name]}: join requested")
                await asyncio.gather(*(one(s) for s in mine))

            asyncio.run(announce())
            return _wait_end(run_dir, procs)
    except (ChildFailed, RuntimeError) as err:
        _say(f"joining instance on {node} failed: {err}")
        return 1
