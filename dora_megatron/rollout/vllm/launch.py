"""vLLM instances of a local job: their process specs and the runtime's adapter for each.

WHY here (and two calls from the launcher): the local launcher starts whatever the plan lists
and builds one client per instance URL; everything vLLM-specific (argv, environment, initial
weight label, switch by reload or restart) stays in this package, so the launcher's diff is one
branch in the plan and one in ``make_engine``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from dora_megatron.processes import ProcessSpec
from dora_megatron.rollout.vllm.server import server_argv, server_env, vllm_python

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.processes import ProcessSet
    from dora_megatron.rollout.vllm.engine import VLLMEngine


class VLLMNotInstalled(RuntimeError):
    """``vllm.python`` does not exist (run tools/setup_vllm.sh)."""


def vllm_problem(cfg: "DoraConfig") -> str | None:
    """Why vLLM instances cannot start (None: they can), found before anything starts."""
    python = vllm_python(cfg.vllm)
    if not os.access(python, os.X_OK):
        return (f"vllm.python: {python} is not an executable interpreter; create the venv with "
                f"`bash tools/setup_vllm.sh {Path(python).parent.parent}` or set vllm.python")
    return None


def local_vllm_engines(cfg: "DoraConfig", model_dir: str, run_dir: str, port0: int | None) -> list[ProcessSpec]:
    """One vLLM server per ``rollout.num_instances`` on this machine, all started on ``model_dir`` (v0)."""
    r = cfg.rollout
    out = []
    for i in range(r.num_instances):
        port = port0 + i if port0 else None
        argv = server_argv(model_dir, r.host, port or "<free-port>", cfg.vllm, r, seed=cfg.run.seed + i)
        env = server_env(cfg.vllm, Path(run_dir) / "vllm_cache" / f"engine{i}", r.threads_per_instance)
        out.append(ProcessSpec("engine", f"engine{i}", r.host, argv, port=port, threads=r.threads_per_instance,
                               env=env, cpus=tuple(cfg.launch.engine_cpus)))
    return out


def served_version(model_path: str, model_dir: str) -> int | None:
    """The version a process started on ``model_path`` serves: 0 for the run's model, else the
    snapshot's recorded version (None if unknown)."""
    if Path(model_path).resolve() == Path(model_dir).resolve():
        return 0
    try:
        return int(json.loads((Path(model_path) / "dora_version.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_vllm_engine(cfg: "DoraConfig", url: str, model_dir: str, procs: "ProcessSet | None") -> "VLLMEngine":
    """The adapter for the instance at ``url``; with ``procs``, MoE-on-CPU switches restart it."""
    from dora_megatron.rollout.vllm.engine import VLLMEngine
    from dora_megatron.rollout.vllm.switch import ProcessRestart, switch_mode

    restart = None
    initial = 0
    if procs is not None:
        port = str(urlsplit(url).port)
        child = next((c for c in procs.children if "--port" in c.argv
                      and c.argv[list(c.argv).index("--port") + 1] == port), None)
        if child is not None:  # a restarted process may serve a later snapshot
            initial = served_version(child.argv[list(child.argv).index("--model") + 1], model_dir)
        if switch_mode(cfg.vllm, model_dir, cfg.rollout.device) == "restart":
            restart = ProcessRestart(procs, url, health_path=cfg.vllm.health_path,
                                     startup_timeout_s=cfg.rollout.startup_timeout_s)
    return VLLMEngine(url, initial_version=initial, restart=restart, timeout_s=cfg.rollout.request_timeout_s)
