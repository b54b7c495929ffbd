"""The process plan of a job: which process runs where, with which ports and ranks.

A plan is plain data computed from the config by a pure function, so
``dora train --dry-run`` can print it and tests can check it without starting
anything. The local launcher executes exactly this plan.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from dora_megatron.processes import ProcessSpec

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def embedded_argv(cfg: "DoraConfig", model_dir: str, host: str, port: int | None) -> tuple[str, ...]:
    """The ``dora serve`` command of one embedded engine (local runs and SLURM rollout nodes alike)."""
    r = cfg.rollout
    return (
        sys.executable, "-m", "dora_megatron", "serve",
        "--model", model_dir, "--host", host, "--port", str(port) if port else "<free-port>",
        "--device", r.device, "--max-running", str(r.max_running), "--max-waiting", str(r.max_waiting),
        "--num-threads", str(r.threads_per_instance), "--dtype", r.dtype,
        "--speculative", r.speculative, "--spec-tokens", str(r.spec_tokens), "--spec-max-batch", str(r.spec_max_batch),
        "--spec-token-cost", str(r.spec_token_cost), "--spec-probe-interval", str(r.spec_probe_interval),
        "--spec-sibling-top-k", str(r.spec_sibling_top_k),
        "--kept-kv-s", str(r.kept_kv_s), "--kept-kv-fraction", str(r.kept_kv_fraction),
        *(("--kv-blocks", str(r.kv_blocks)) if r.kv_blocks else ()),
        *(("--context-length", str(r.context_length)) if r.context_length else ()),
    )


def local_plan(cfg: "DoraConfig", model_dir: str, run_dir: str, base_port: int | None = None) -> list[ProcessSpec]:
    """All processes of a local run: N engines, the trainer (torchrun), the controller."""
    host = cfg.rollout.host
    port0 = cfg.rollout.base_port if base_port is None else base_port
    plan: list[ProcessSpec] = []
    if cfg.rollout.engine == "sglang":
        from dora_megatron.rollout.sglang.launch import local_sglang_engines

        plan.extend(local_sglang_engines(cfg, model_dir, port0))
    if cfg.rollout.engine == "vllm":
        from dora_megatron.rollout.vllm.launch import local_vllm_engines

        plan.extend(local_vllm_engines(cfg, model_dir, run_dir, port0))
    for i in range(cfg.rollout.num_instances if cfg.rollout.engine == "embedded" else 0):
        port = port0 + i if port0 else None  # None: the launcher picks a free port
        plan.append(ProcessSpec("engine", f"engine{i}", host, embedded_argv(cfg, model_dir, host, port), port=port,
                                threads=cfg.rollout.threads_per_instance,
                                env=thread_env(cfg.rollout.threads_per_instance), cpus=tuple(cfg.launch.engine_cpus)))
    nprocs = cfg.launch.trainer_procs
    trainer_argv = (
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
        "-m", "dora_megatron.trainer.service", "--run-dir", run_dir, "--model", model_dir,
    )
    plan.append(ProcessSpec("trainer", "trainer", host, trainer_argv, threads=cfg.launch.trainer_threads,
                            ranks=tuple(range(nprocs)), env=thread_env(cfg.launch.trainer_threads),
                            cpus=tuple(cfg.launch.trainer_cpus)))
    plan.append(ProcessSpec("controller", "controller", host, ("<in-process>",), threads=1))
    return plan


def format_plan(plan: list[ProcessSpec]) -> str:
    lines = ["process plan:"]
    for p in plan:
        extra = []
        if p.port is not None:
            extra.append(f"port={p.port}")
        if p.ranks:
            extra.append(f"ranks={list(p.ranks)}")
        if p.gpus:
            extra.append(f"gpus={list(p.gpus)}")
        extra.extend(f"{k}={v}" for k, v in sorted(p.extra_ports.items()))
        extra.append(f"threads={p.threads}")
        if p.cpus:
            extra.append(f"cpus={list(p.cpus)}")
        lines.append(f"  [{p.role:10s}] {p.name:12s} host={p.host} {' '.join(extra)}")
        lines.append(f"      $ {p.command_line()}")
    return "\n".join(lines)
