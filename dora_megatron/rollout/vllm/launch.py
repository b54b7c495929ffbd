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

from dora_megatron.processes import ProcessSpec
from dora_megatron.rollout.vllm.server import server_argv, server_env, vllm_python

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.processes import ProcessSet
    from dora_megatron.rollout.vllm.engine import VLLMEngine


def vllm_problem(cfg: "DoraConfig") -> str | None:
    """Why vLLM instances cannot start (None: they can), found before anything starts."""
    python = vllm_python(cfg.vllm)
    if not os.access(python, os.X_OK):
        return (f"vllm.python: {python} is not an executable interpreter; create the venv with "
                f"`bash tools/setup_vllm.sh {Path(python).parent.parent}` or set vllm.python")
    return model_problem(cfg.model.path) if cfg.model.path else None


def model_problem(model_dir: str) -> str | None:
    """What vLLM 0.32.0 would serve differently from the checkpoint in ``model_dir`` (None:
    nothing known). Its ``qwen2_moe.py`` takes the head size as ``hidden_size /
    num_attention_heads`` and ignores a ``head_dim`` of ``config.json``: such a model would load
    and answer with heads of the wrong size, silently."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the model directory's own check names it
    if config.get("model_type") == "qwen2_moe" and config.get("head_dim") is not None:
        derived = int(config["hidden_size"]) // int(config["num_attention_heads"])
        if int(config["head_dim"]) != derived:
            return (f"model.path: {path}: head_dim {config['head_dim']} differs from hidden_size / "
                    f"num_attention_heads = {derived}, which vLLM 0.32.0's qwen2_moe model uses instead; "
                    "use rollout.engine: embedded or sglang for this model")
    return None


def vllm_engine_spec(cfg: "DoraConfig", name: str, host: str, port: int | None, model_dir: str, run_dir: str, *,
                     seed: int, cpus: tuple[int, ...] = ()) -> ProcessSpec:
    """One vLLM server bound to ``host:port``, started on ``model_dir`` (v0), its caches in
    ``<run_dir>/vllm_cache/<name>`` (local runs and SLURM nodes alike; names are unique in a job)."""
    r = cfg.rollout
    argv = server_argv(model_dir, host, port or "<free-port>", cfg.vllm, r, seed=seed)
    env = server_env(cfg.vllm, Path(run_dir) / "vllm_cache" / name, r.threads_per_instance)
    return ProcessSpec("engine", name, host, argv, port=port, threads=r.threads_per_instance, env=env, cpus=cpus)


def local_vllm_engines(cfg: "DoraConfig", model_dir: str, run_dir: str, port0: int | None) -> list[ProcessSpec]:
    """One vLLM server per ``rollout.num_instances`` on this machine, all started on ``model_dir`` (v0)."""
    r = cfg.rollout
    return [vllm_engine_spec(cfg, f"engine{i}", r.host, port0 + i if port0 else None, model_dir, run_dir,
                             seed=cfg.run.seed + i, cpus=tuple(cfg.launch.engine_cpus))
            for i in range(r.num_instances)]


def served_version(model_path: str, model_dir: str) -> int | None:
    """The version a process started on ``model_path`` serves: 0 for the run's model, else the
    snapshot's recorded version (None if unknown)."""
    if Path(model_path).resolve() == Path(model_dir).resolve():
        return 0
    try:
        return int(json.loads((Path(model_path) / "dora_version.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_vllm_engine(cfg: "DoraConfig", url: str, model_dir: str, procs: "ProcessSet | None",
                     run_dir: str | Path | None = None) -> "VLLMEngine":
    """The adapter for the instance at ``url``.

    Where versions switch by restart (MoE on CPU, :func:`~.switch.switch_mode`), the instance is
    restarted by this launcher when it is one of ``procs``'s children, else (another node of a
    SLURM job) by its node's launcher through ``<run_dir>/vllm_restart``. With neither, the adapter
    is refused: a reload would leave the experts stale under the new version's label (C1)."""
    from dora_megatron.rollout.vllm.engine import VLLMEngine
    from dora_megatron.rollout.vllm.switch import (FileRestart, ProcessRestart, child_serving, remote_served_model,
                                                   restart_dir, switch_mode)

    child = child_serving(procs, url) if procs is not None else None
    served = (child.argv[list(child.argv).index("--model") + 1] if child is not None  # a restarted process
              else remote_served_model(restart_dir(run_dir), url) if run_dir is not None else None)
    initial = served_version(served, model_dir) if served else 0  # may serve a later snapshot
    restart = None
    if switch_mode(cfg.vllm, model_dir, cfg.rollout.device) == "restart":
        timeouts = {"health_path": cfg.vllm.health_path, "startup_timeout_s": cfg.rollout.startup_timeout_s}
        if child is not None:
            restart = ProcessRestart(procs, url, **timeouts)
        elif run_dir is not None:
            restart = FileRestart(restart_dir(run_dir), url, **timeouts)
        else:
            raise ValueError(f"vllm.switch: {url} must switch versions by restart, and this launcher can "
                             "restart neither it nor its node's processes")
    return VLLMEngine(url, initial_version=initial, restart=restart, timeout_s=cfg.rollout.request_timeout_s)
