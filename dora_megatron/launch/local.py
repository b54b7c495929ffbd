"""The local launcher: every process of a job on this machine, on loopback.

``dora train`` with ``launch.backend: local`` lands here. It prepares the run
directory (resolved config, model), starts ``rollout.num_instances`` engine
processes (each the same ``dora serve`` command a user runs) and the trainer
(torchrun, gloo), and runs the controller in this process through its one entry point
(:func:`dora_megatron.controller.main.run_controller`: waits for the processes, runs the job, writes
the outputs: ``summary.json``, TensorBoard, ``timeline.png``, ``trace.json``, ``steps.jsonl``)
and stops every child on success, error or Ctrl-C (the first Ctrl-C or SIGTERM after a checkpoint
at the next step boundary, :mod:`.stop`). While it runs, an engine process that dies
is restarted and rejoins the pool (:mod:`.supervise`); ``--resume`` picks the newest checkpoint
that passes its checksum manifest and restores finished samples from the controller's journal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from dora_megatron.comm import auth
from dora_megatron.config.loader import dump_yaml
from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.main import Endpoints, connection_plan, run_controller
from dora_megatron.controller.outputs import steps_done_at
from dora_megatron.launch.inputs import input_problem
from dora_megatron.launch.plan import local_plan
from dora_megatron.launch.process_launcher import ProcessLauncher, write_processes
from dora_megatron.launch.startup import StartupRefused
from dora_megatron.launch.stop import Stopped, StopSignals, exit_status
from dora_megatron.launch.trainer_restart import TrainerRestarts, restart_trainer, run_restarting
from dora_megatron.observability.summary import write_summary
from dora_megatron.ports import job_port_range, pick_ports
from dora_megatron.processes import ChildFailed, ProcessSet, ProcessSpec

log = logging.getLogger(__name__)


def make_run_dir(cfg: DoraConfig) -> Path:
    if cfg.run.run_dir:
        run_dir = Path(cfg.run.run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg.run.output_dir) / cfg.run.dir_name(cfg.orchestrator.mode, stamp)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


def prepare_model(cfg: DoraConfig, run_dir: Path, say=print) -> Path:
    """The HF model directory of version 0: ``model.path`` (checked by
    :func:`~dora_megatron.launch.inputs.input_problem` before anything starts), or a preset
    (optionally warm-started)."""
    if cfg.model.path:
        return Path(cfg.model.path).resolve()
    from dora_megatron.models.presets import create_model_dir

    path = run_dir / "model"
    if (path / "model.safetensors").is_file():
        return path
    create_model_dir(cfg.model.preset, path, seed=cfg.run.seed)
    if cfg.model.warm_start:
        from dora_megatron.models.warm_start import run_warm_start

        d = cfg.data
        run_warm_start(path, cfg.model.warm_start, cfg.model.warm_start_steps, seed=cfg.run.seed, say=say,
                       task_kwargs={"min_len": d.min_len, "max_len": d.max_len, "exponent": d.length_exponent})
    return path


def resume_checkpoint(run_dir: Path, say, quarantine: bool = True) -> tuple[Path | None, str]:
    """The checkpoint ``--resume`` continues from: the newest one that matches its checksum
    manifest and whose weight snapshots still exist, falling back to older ones (each rejected
    one is reported through ``say``). Returns ``(checkpoint, "")`` or ``(None, error message)``."""
    from dora_megatron.controller.checkpoint_manifest import choose_checkpoint

    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=say, quarantine=quarantine)
    return choice.checkpoint, ("" if choice.checkpoint is not None else choice.error(run_dir))


def stopped_line(summary: dict[str, Any], run_dir: Path) -> str:
    """What a job stopped by a signal says: where it stopped and how to go on."""
    why = summary["stopped_by"]
    if summary["status"] == "stopped":
        return (f"stopped by {why} after {summary['steps']} step(s): checkpoint v{summary['stop_checkpoint']:06d} "
                f"written; every process was stopped; `dora train --resume {run_dir}` continues the run")
    return (f"stopped by {why} after {summary['steps']} step(s) without a new checkpoint (the step in progress did "
            f"not end within controller.stop_checkpoint_timeout_s); every process was stopped; "
            f"`dora train --resume {run_dir}` continues from the last complete checkpoint, if any")


def run_local_job(cfg: DoraConfig, resume: str | None = None) -> int:
    say = _Say()
    try:  # before any process starts: a concurrency that cannot run is refused at once
        connection_plan(cfg, cfg.rollout.num_instances)
    except ValueError as err:
        say(f"dora train: {err}")
        return 2
    problem = input_problem(cfg)
    if problem:
        say(f"dora train: {problem}")
        return 2
    checkpoint = None
    if resume:
        run_dir = Path(resume).resolve()
        checkpoint, error = resume_checkpoint(run_dir, say)
        if checkpoint is None:
            say(error)
            return 2
        done = steps_done_at(checkpoint)
        if done >= cfg.run.steps:  # nothing left to train: say so instead of starting every process
            say(f"run {run_dir} is complete: {done} of run.steps={cfg.run.steps} steps done ({checkpoint.name}); "
                f"to train further: dora train --resume {run_dir} --set run.steps=N (N > {done})")
            return 0
        say(f"resuming {run_dir} from {checkpoint.name}")
    else:
        run_dir = make_run_dir(cfg)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    say(f"run directory: {run_dir}")
    model_dir = prepare_model(cfg, run_dir, say=say)
    host = cfg.rollout.host
    ports = pick_ports(cfg.rollout.num_instances + 1, host, job_port_range(cfg.launch.port_range))
    base_port = cfg.rollout.base_port or None
    engine_ports = [base_port + i for i in range(cfg.rollout.num_instances)] if base_port else ports[:-1]
    trainer_port = cfg.launch.trainer_port or ports[-1]
    plan = local_plan(cfg, str(model_dir), str(run_dir), base_port=engine_ports[0])
    # free ports need not be consecutive: patch each engine's --port to its own
    plan = [_with_port(p, engine_ports[i]) if p.role == "engine" else p for i, p in enumerate(plan)]
    from dora_megatron.rollout.sglang.server import start_instance

    # Ctrl-C, kill, scancel: the first one checkpoints at the next step boundary, the second unwinds at once
    signals = StopSignals()
    try:
        # the job's secret reaches every process through the environment (README: Security)
        with auth.job_environment(run_dir, cfg.launch.secret_file), signals, ProcessSet(run_dir / "logs", grace_s=cfg.launch.shutdown_timeout_s) as procs:
            for spec in plan:
                if spec.role == "engine":  # SGLang reads the job's keys from a 0600 file (--config)
                    start_instance(procs, spec, cfg.rollout.engine)
                elif spec.role == "trainer":
                    argv = list(spec.argv) + ["--host", host, "--port", str(trainer_port)]
                    if checkpoint is not None:
                        argv += ["--resume", str(checkpoint / "trainer")]
                    procs.start("trainer", argv, {**spec.env, "PYTHONUNBUFFERED": "1"}, cpus=spec.cpus)
            write_processes(run_dir, procs)
            endpoints = Endpoints({f"engine{i}": f"http://{host}:{p}" for i, p in enumerate(engine_ports)},
                                  f"http://{host}:{trainer_port}")
            budget = TrainerRestarts(cfg.launch.max_trainer_restarts)
            summary = run_restarting(
                lambda ck: asyncio.run(run_controller(cfg, endpoints, run_dir, model_dir,
                                                      ProcessLauncher(cfg, procs, run_dir, host=host), say, ck,
                                                      stop_signals=signals, trainer_restarts=budget.used)),
                lambda err: restart_trainer(cfg, procs, endpoints.engines, run_dir, model_dir, err, budget, say,
                                            on_started=lambda: write_processes(run_dir, procs)),
                checkpoint, budget)
    except (ChildFailed, TimeoutError, ValueError, StartupRefused) as err:  # auth.SecretError is a ValueError
        say(f"dora train failed: {err}")
        return 1
    except Stopped as err:
        say("interrupted; every process was stopped" if err.signame == "SIGINT" else
            f"terminated ({err.signame}); every process was stopped")
        return exit_status(err.signame)
    except KeyboardInterrupt:  # SIGINT outside the handler's reach (a non-main thread started the job)
        say("interrupted; every process was stopped")
        return 130
    if summary["status"] != "completed":
        say(stopped_line(summary, run_dir))
        return exit_status(summary["stopped_by"])
    _heldout_eval(cfg, run_dir, model_dir, summary, say)
    if cfg.observability.overview:  # after the held-out rates: the figure shows them
        _write_overview(run_dir, cfg.orchestrator.mode, say)
    say(_summary_line(summary))
    say(f"outputs in {run_dir}")
    return 0


def _write_overview(run_dir: Path, mode: str, say) -> None:
    """``overview.png`` from the run's ``steps.jsonl`` and ``summary.json``. A figure that cannot be
    drawn is reported and the run still succeeds: every number it would show is already written."""
    from dora_megatron.observability.overview import write_run_overview

    try:
        path = write_run_overview(run_dir, title=f"{mode}: run overview ({run_dir.name})")
    except (OSError, ValueError, ImportError) as err:
        say(f"no overview.png: {type(err).__name__}: {err}")
        return
    if path is not None:
        say(f"run overview: {path}")


def _heldout_eval(cfg: DoraConfig, run_dir: Path, model_dir: Path, summary: dict[str, Any], say) -> None:
    """Held-out exact-answer rates of the initial and the final weights (after every process stopped).

    Adds ``heldout_exact_initial`` / ``heldout_exact_final`` / ``heldout_prompts`` to ``summary``
    (null when off or not applicable), rewrites ``summary.json`` and writes ``heldout.json``."""
    from dora_megatron.data.tasks import DIGIT_TASKS

    summary.update(heldout_exact_initial=None, heldout_exact_final=None, heldout_prompts=0)
    obs, data = cfg.observability, cfg.data
    final = None
    if obs.heldout_prompts > 0 and data.task in DIGIT_TASKS:
        from dora_megatron.observability.heldout import evaluate_model, heldout_prompts, latest_snapshot

        final = latest_snapshot(run_dir)
        if final is None:
            say("held-out evaluation skipped: no weight snapshot in the run directory")
    if final is not None:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        prompts = heldout_prompts(data.task, data.min_len, data.max_len, data.length_exponent, data.seed,
                                  obs.heldout_prompts)
        say(f"held-out evaluation: {len(prompts)} prompts, initial weights vs {final.name} ...")
        results = []
        for decode in ("sample", "greedy") if obs.heldout_greedy else ("sample",):
            for which, path in (("initial", model_dir), ("final", final)):
                res = evaluate_model(path, prompts, decode, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                     stop_token_ids=cfg.rollout.stop_token_ids,
                                     max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.run.seed)
                results.append({"weights": which, **res.to_json()})
                say(f"held-out {which:7} {res.line()}")
                if decode == "sample":
                    summary[f"heldout_exact_{which}"] = res.exact
        summary["heldout_prompts"] = len(prompts)
        (run_dir / "heldout.json").write_text(json.dumps(results, indent=2) + "\n")
        if obs.tensorboard and summary["heldout_exact_final"] is not None:
            from dora_megatron.observability.tensorboard import write_heldout

            write_heldout(run_dir / "tb", summary["heldout_exact_initial"], summary["heldout_exact_final"],
                          int(final.name[1:]))
    write_summary(run_dir, summary)


def _with_port(spec: ProcessSpec, port: int) -> ProcessSpec:
    import dataclasses

    argv = list(spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    return dataclasses.replace(spec, argv=tuple(argv), port=port)


def _summary_line(s: dict[str, Any]) -> str:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    heldout = (f", held-out exact {f(s['heldout_exact_initial'])} -> {f(s['heldout_exact_final'])}"
               if s.get("heldout_exact_final") is not None else "")
    return (f"done: {s['steps']} steps in {f(s['wall_time_s'], '{:.1f}')} s, reward {f(s['reward_first'])} -> "
            f"{f(s['reward_last'])}{heldout}, throughput {f(s['throughput_tokens_per_s'], '{:.1f}')} tok/s, rollout-only "
            f"{f(s['rollout_only_fraction'])}, lost {s['lost_groups']}, duplicated {s['duplicated_groups']}, "
            f"C1 {s['c1_violations']}, C3 {s['c3_violations']}, migrations {s['migrations']}")


class _Say:
    """User-facing progress lines (stderr), also logged."""

    def __call__(self, msg: str) -> None:
        log.info(msg)
        if not logging.getLogger().isEnabledFor(logging.INFO):
            sys.stderr.write(msg + "\n")
