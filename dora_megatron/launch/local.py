"""The local launcher: every process of a job on this machine, on loopback.

``dora train`` with ``launch.backend: local`` lands here. It prepares the run
directory (resolved config, model), starts ``rollout.num_instances`` engine
processes (each the same ``dora serve`` command a user runs) and the trainer
(torchrun, gloo), waits for all of them to be healthy, runs the controller
(:mod:`dora_megatron.controller.runtime`) in this process, writes the outputs
(``summary.json``, TensorBoard, ``timeline.png``, ``trace.json``, ``steps.jsonl``)
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
from typing import Any, Callable

from dora_megatron.config.loader import dump_yaml
from dora_megatron.config.schema import DoraConfig
from dora_megatron.controller.build import Endpoints
from dora_megatron.launch.inputs import input_problem
from dora_megatron.launch.plan import local_plan
from dora_megatron.launch.startup import StartupRefused
from dora_megatron.launch.stop import Stopped, StopSignals, exit_status
from dora_megatron.launch.trainer_restart import (TrainerLost, TrainerRestarts, restart_trainer, run_restarting,
                                                  watch_trainer)
from dora_megatron.ports import free_ports
from dora_megatron.processes import ChildFailed, ProcessSet, ProcessSpec
from dora_megatron.rollout.health import wait_ready
from dora_megatron.rollout.factory import engine_for

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


def _trainer_alive(procs: ProcessSet) -> Callable[[], bool]:
    """:func:`wait_ready`'s ``alive`` for the trainer: a trainer child that exited ends the start with
    :class:`ChildFailed`, naming it (an engine that exits is the start-up wait's: it is restarted)."""
    def alive() -> bool:
        for c in procs.children:
            if c.name == "trainer" and not c.alive():
                raise ChildFailed(c.failure())
        return True
    return alive


def resume_checkpoint(run_dir: Path, say, quarantine: bool = True) -> tuple[Path | None, str]:
    """The checkpoint ``--resume`` continues from: the newest one that matches its checksum
    manifest and whose weight snapshots still exist, falling back to older ones (each rejected
    one is reported through ``say``). Returns ``(checkpoint, "")`` or ``(None, error message)``."""
    from dora_megatron.controller.checkpoint_manifest import choose_checkpoint

    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=say, quarantine=quarantine)
    return choice.checkpoint, ("" if choice.checkpoint is not None else choice.error(run_dir))


def drop_steps_from(path: Path, first: int) -> int:
    """Remove the lines of steps >= ``first`` from a step record (``steps.jsonl``, ``consumed.jsonl``;
    atomically): the crashed lineage's steps after the checkpoint, which the resumed run does
    again. Returns how many."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = int(json.loads(line)["step"]) < first
        except (ValueError, KeyError, TypeError):  # a line torn by the crash: not a step record
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)
    return dropped


def open_run_records(run_dir: Path, resumed_at: int | None):
    """``steps.jsonl`` and ``consumed.jsonl`` opened for this run's steps: new files, or on a resume
    from the checkpoint of version ``resumed_at`` the existing ones without the crashed lineage's
    records of steps >= it (those steps are trained again from the checkpoint, on the groups it
    kept: left in, they would list those groups twice). Each step of the final lineage is then
    recorded once, which :func:`duplicated_in_record` checks."""
    if resumed_at is None:
        return open(run_dir / "steps.jsonl", "w"), open(run_dir / "consumed.jsonl", "w")
    drop_steps_from(run_dir / "steps.jsonl", resumed_at)
    drop_steps_from(run_dir / "consumed.jsonl", resumed_at)
    return open(run_dir / "steps.jsonl", "a"), open(run_dir / "consumed.jsonl", "a")


def duplicated_in_record(path: Path) -> int:
    """Groups ``consumed.jsonl`` lists more than once (each one beyond its first listing): the
    exactly-once check of the run's own record, the one ``--resume`` continues."""
    if not path.is_file():
        return 0
    seen: set[str] = set()
    dup = 0
    for line in path.read_text().splitlines():
        try:
            groups = json.loads(line)["groups"]
        except (ValueError, KeyError, TypeError):  # a line torn by a crash: dropped by the next resume
            continue
        for g in groups:
            dup += g in seen
            seen.add(g)
    return dup


def stopped_line(summary: dict[str, Any], run_dir: Path) -> str:
    """What a job stopped by a signal says: where it stopped and how to go on."""
    why = summary["stopped_by"]
    if summary["status"] == "stopped":
        return (f"stopped by {why} after {summary['steps']} step(s): checkpoint v{summary['stop_checkpoint']:06d} "
                f"written; every process was stopped; `dora train --resume {run_dir}` continues the run")
    return (f"stopped by {why} after {summary['steps']} step(s) without a new checkpoint (the step in progress did "
            f"not end within controller.stop_checkpoint_timeout_s); every process was stopped; "
            f"`dora train --resume {run_dir}` continues from the last complete checkpoint, if any")


def _steps_done(checkpoint: Path) -> int:
    """Training steps finished at ``checkpoint``: its version (step ``t`` produces version ``t + 1``)."""
    return int(json.loads((checkpoint / "controller.json").read_text())["version"])


def connection_plan(cfg: DoraConfig, instances: int, say=None):
    """This process's connection budget for ``instances`` (:mod:`dora_megatron.comm.limits`): the
    soft open-files limit raised to the hard one (logged old -> new), each instance's pool sized
    from it. Refuses (:class:`~dora_megatron.config.base.ConfigError` naming
    ``rollout.client_workers`` and the numbers) when not one generate connection per instance
    fits; ``say``: where the warning goes when not every slot gets its own connection (requests
    then wait for one, counted as ``connection_waits``)."""
    from dora_megatron.comm.limits import ConnectionBudgetError, plan_connections, raise_open_files_limit
    from dora_megatron.config.base import ConfigError

    old, new = raise_open_files_limit()
    if say is not None and new != old:
        say(f"open-files limit raised from {old} to {new} (the hard limit)")
    try:
        plan = plan_connections(instances, cfg.orchestrator.cap_before_rebalance, new,
                                client_workers=cfg.rollout.client_workers)
    except ConnectionBudgetError as err:
        raise ConfigError("rollout.client_workers", str(err)) from err
    if say is not None and not plan.fits:
        say(f"warning: {plan.describe()} of {plan.slots} slots; requests beyond them wait for a connection "
            f"(connection_waits in summary.json): raise the hard open-files limit or set rollout.client_workers")
    return plan


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
        done = _steps_done(checkpoint)
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
    ports = free_ports(cfg.rollout.num_instances + 1, host)
    base_port = cfg.rollout.base_port or None
    engine_ports = [base_port + i for i in range(cfg.rollout.num_instances)] if base_port else ports[:-1]
    trainer_port = cfg.launch.trainer_port or ports[-1]
    plan = local_plan(cfg, str(model_dir), str(run_dir), base_port=engine_ports[0])
    # free ports need not be consecutive: patch each engine's --port to its own
    plan = [_with_port(p, engine_ports[i]) if p.role == "engine" else p for i, p in enumerate(plan)]
    # Ctrl-C, kill, scancel: the first one checkpoints at the next step boundary, the second unwinds at once
    signals = StopSignals()
    try:
        with signals, ProcessSet(run_dir / "logs", grace_s=cfg.launch.shutdown_timeout_s) as procs:
            for spec in plan:
                if spec.role == "engine":
                    procs.start(spec.name, spec.argv, spec.env, cpus=spec.cpus)
                elif spec.role == "trainer":
                    argv = list(spec.argv) + ["--host", host, "--port", str(trainer_port)]
                    if checkpoint is not None:
                        argv += ["--resume", str(checkpoint / "trainer")]
                    procs.start("trainer", argv, {**spec.env, "PYTHONUNBUFFERED": "1"}, cpus=spec.cpus)
            _write_processes(run_dir, procs)
            endpoints = Endpoints({f"engine{i}": f"http://{host}:{p}" for i, p in enumerate(engine_ports)},
                                  f"http://{host}:{trainer_port}")
            budget = TrainerRestarts(cfg.launch.max_trainer_restarts)
            summary = run_restarting(
                lambda ck: asyncio.run(run_controller(cfg, endpoints, run_dir, model_dir, procs, say, ck, host=host,
                                                      stop_signals=signals, trainer_restarts=budget.used)),
                lambda err: restart_trainer(cfg, procs, endpoints.engines, run_dir, model_dir, err, budget, say,
                                            on_started=lambda: _write_processes(run_dir, procs)),
                checkpoint, budget)
    except (ChildFailed, TimeoutError, ValueError, StartupRefused) as err:
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


def _earlier_steps(run_dir: Path) -> dict[str, Any]:
    """A resumed run's step rows and staleness histogram before the checkpoint (``steps.jsonl``
    already cut at it, ``consumed.jsonl``), to seed :class:`CheckpointOverviews`."""
    from dora_megatron.observability.overview import read_steps

    rows = read_steps(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").is_file() else []
    done = {int(r["step"]) for r in rows}
    hist: dict[int, int] = {}
    path = run_dir / "consumed.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the crash
            continue
        if int(entry.get("step", -1)) in done:
            for v in entry.get("versions", ()):
                hist[int(entry["step"]) - int(v)] = hist.get(int(entry["step"]) - int(v), 0) + 1
    return {"rows": rows, "staleness": hist}


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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _with_port(spec: ProcessSpec, port: int) -> ProcessSpec:
    import dataclasses

    argv = list(spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    return dataclasses.replace(spec, argv=tuple(argv), port=port)


async def run_controller(cfg: DoraConfig, endpoints, run_dir: Path, model_dir: Path, procs: ProcessSet, say,
                         checkpoint: Path | None = None, *, host: str = "127.0.0.1", fixed_ports: bool = False,
                         on_runtime=None, stop_signals=None, trainer_restarts: int = 0) -> dict[str, Any]:
    """Run the controller of a job whose processes are started: wait until ``endpoints``
    (:class:`~dora_megatron.controller.build.Endpoints`) answer, build the controller
    (:func:`~dora_megatron.controller.build.build_controller`), supervise the engines this launcher
    started (``procs``; restarted ones come back on ``host``, on their planned port when
    ``fixed_ports``), run it and write the outputs. ``on_runtime(runtime)`` runs once the runtime
    exists (e.g. to start the elastic join watcher). ``stop_signals``
    (:class:`~dora_megatron.launch.stop.StopSignals`): while the runtime runs, the first signal
    asks it to stop at the next step boundary with a checkpoint (the summary's ``status`` then
    says ``stopped``; the Hugging Face export is skipped). A trainer that dies or stays silent for
    ``controller.trainer_timeout_s`` ends it with :class:`TrainerLost` (the caller may restart
    it); ``trainer_restarts``: how many times it was restarted before (``summary.json``)."""
    from dora_megatron.controller.build import build_controller
    from dora_megatron.controller.trainer_client import TrainerError, TrainerUnreachable
    from dora_megatron.data.sources import skipped_rows
    from dora_megatron.observability.background import BackgroundWriter
    from dora_megatron.observability.recorder import StepsJsonl
    from dora_megatron.observability.tensorboard import NullWriter, TensorBoardWriter
    from dora_megatron.observability.timeline import Timeline
    from dora_megatron.weights.export import export_final

    t_start = time.monotonic()
    urls, trainer_url = endpoints.engines, endpoints.trainer
    names = list(urls)

    pool = None  # rollout.client_workers > 0: the instances' HTTP clients run in worker processes
    from dora_megatron.comm.limits import ConnectionWaits

    conn_plan = connection_plan(cfg, len(urls), say)  # refuses before waiting on thousands of instances
    waits = ConnectionWaits()

    def make_engine(url: str):
        if pool is not None:
            return pool.engine(url)
        return engine_for(cfg, url, str(model_dir), procs, run_dir, plan=conn_plan, waits=waits)

    health_path = cfg.vllm.health_path if cfg.rollout.engine == "vllm" else "/health"
    from dora_megatron.launch.supervise import EngineSupervisor, RestartPolicy, restart_engine
    from dora_megatron.launch.startup import wait_for_instances

    # SLURM jobs (fixed_ports): instances on this node come back on their planned port and host
    policy = RestartPolicy(enabled=cfg.launch.restart_engines,
                           max_restarts=cfg.launch.max_engine_restarts,
                           startup_timeout_s=cfg.rollout.startup_timeout_s,
                           fixed_port=bool(cfg.rollout.base_port) or fixed_ports, host=host,
                           health_path=health_path)
    say(f"waiting for {len(urls)} engines and the trainer ({cfg.launch.trainer_procs} rank(s)) ...")
    instances = await _first_error(
        wait_for_instances(urls, procs, min_ready=cfg.launch.min_ready_instances,
                           timeout_s=cfg.rollout.startup_timeout_s, health_path=health_path,
                           restart=(lambda n: restart_engine(procs, n, policy)) if policy.enabled else None,
                           max_restarts=cfg.launch.max_engine_restarts,
                           on_restarted=lambda: _write_processes(run_dir, procs)),
        wait_ready(trainer_url, timeout_s=cfg.launch.trainer_startup_timeout_s, interval_s=0.25,
                   alive=_trainer_alive(procs), what="trainer"),
    )
    urls = instances.urls
    endpoints = Endpoints(dict(urls), trainer_url)
    if instances.absent:
        say(f"starting with {len(instances.ready)} of {len(urls)} rollout instance(s) after "
            f"{time.monotonic() - t_start:.1f} s; the others join once ready: "
            + "; ".join(f"{n}: {why}" for n, why in sorted(instances.absent.items())))
    else:
        say(f"all processes healthy after {time.monotonic() - t_start:.1f} s")
    if cfg.rollout.engine == "sglang":
        from dora_megatron.rollout.sglang.server import check_versions

        for warning in await check_versions([urls[n] for n in sorted(instances.ready)]):
            say(f"warning: {warning}")
    obs = cfg.observability
    resuming = checkpoint is not None
    resumed_at = _steps_done(checkpoint) if resuming else None  # steps >= it are re-done: keep only the new ones
    # a trainer restarted without a checkpoint re-does every step: hide the lost lineage's scalars from step 0
    purge = resumed_at if resuming else (0 if trainer_restarts else None)
    writer = TensorBoardWriter(run_dir / "tb", purge_step=purge) if obs.tensorboard else NullWriter()
    # the slow writes of the run (rollout dumps, checkpoint overviews) run here, off the event loop
    background = BackgroundWriter()
    timeline = Timeline() if obs.timeline else None
    progress = _Progress(cfg.run.steps, enabled=obs.progress)
    steps_file, consumed_file = open_run_records(run_dir, resumed_at)
    overviews = None  # overview.png at each checkpoint, drawn on the background writer
    if obs.overview and cfg.run.checkpoint_interval > 0:
        from dora_megatron.observability.overview import CheckpointOverviews

        overviews = CheckpointOverviews(run_dir / "overview.png", background, max_staleness=cfg.orchestrator.max_staleness,
                                        title=f"{cfg.orchestrator.mode}: run overview ({run_dir.name})",
                                        **(_earlier_steps(run_dir) if resuming else {}))

    def on_step(s, rt) -> None:
        retention.prune()
        consumed_file.write(json.dumps({"step": s.step, "groups": s.group_ids, "versions": s.group_versions}) + "\n")
        consumed_file.flush()
        progress.update(s.step, rt.metrics.last)
        if overviews is not None:
            overviews.step(s.step, rt.metrics.last, s.staleness)

    def on_checkpoint(version: int) -> None:
        retention.checkpointed(version)
        if overviews is not None:
            overviews.checkpoint(version)

    if cfg.rollout.client_workers > 0:
        from dora_megatron.controller.records import RuntimeOptions
        from dora_megatron.rollout.sharded import ClientPool

        pool = await ClientPool.start(cfg, str(model_dir), cfg.rollout.client_workers, log_dir=run_dir / "logs", poll={
            "interval_s": obs.stats_interval_s, "health_timeout_s": cfg.controller.health_timeout_s,
            "concurrency": RuntimeOptions.stats_concurrency}, plan=conn_plan)
    retention = _SnapshotRetention(run_dir, lambda: ctl.orch.live_versions())
    sinks = [writer, StepsJsonl(steps_file)]
    if obs.wandb:
        from dora_megatron.config.loader import to_dict
        from dora_megatron.observability.wandb_writer import WandbWriter

        sinks.append(WandbWriter(run_dir, obs.wandb_project, config=to_dict(cfg)))
    ctl = build_controller(cfg, endpoints, run_dir=run_dir, model_dir=model_dir, make_engine=make_engine,
                           checkpoint=checkpoint, on_step=on_step, on_checkpoint=on_checkpoint,
                           timeline=timeline, metric_sinks=sinks,
                           eval_sinks=[writer],  # not W&B: a round ends after later steps, W&B drops older steps
                           load_reports=pool, background=background)
    runtime, trainer, engines, orch = ctl.runtime, ctl.trainer, ctl.engines, ctl.orch
    runtime.connection_waits = pool.connection_waits if pool is not None else waits
    say(f"reward: {ctl.reward_name}")
    if cfg.run.checkpoint_interval == 0:  # no mid-run checkpoint to resume from: only live versions matter
        retention.min_live_at_checkpoint = float("inf")
    if ctl.state is not None:
        retention.min_live_at_checkpoint = min(orch.live_versions())
        if ctl.journal is not None:
            say(f"journal: {ctl.restorable_samples} finished sample(s) after {checkpoint.name} may be restored")
    if on_runtime is not None:
        on_runtime(runtime)
    runtime.start_without(instances.absent, instances.loading)
    supervisor = EngineSupervisor(procs, runtime, policy, make_engine, names,
                                  on_restarted=lambda: _write_processes(run_dir, procs))
    supervisor.attempts.update(instances.attempts)  # one budget per instance, start-up restarts included
    if policy.enabled and instances.attempts:
        runtime.engine_restarts = sum(instances.attempts.values())
    for name, why in sorted(instances.absent.items()):
        supervisor.expect(name, urls[name], why)
    monitor = asyncio.get_running_loop().create_task(supervisor.run())
    watchdog = asyncio.get_running_loop().create_task(
        watch_trainer(trainer.health, cfg.controller.trainer_timeout_s, runtime.stop))
    if stop_signals is not None:
        stop_signals.arm_runtime(runtime)
    try:
        summary = await runtime.run()
    except TrainerUnreachable as err:
        raise await _trainer_failure(procs, err) from err
    except TrainerError as err:  # the trainer answered with an error (its log has the traceback)
        raise await _trainer_failure(procs, err, wait_s=5.0, answered=f"{err} (see {run_dir / 'logs' / 'trainer.log'})")
    finally:
        if stop_signals is not None:
            stop_signals.disarm()  # from here a signal unwinds at once
        monitor.cancel()
        watchdog.cancel()
        await asyncio.gather(monitor, watchdog, return_exceptions=True)
        ctl.close_journal()
        ctl.close_reward()
        progress.close()
        steps_file.close()
        consumed_file.close()
        writer.close()
        for sink in sinks[2:]:  # observability.wandb
            sink.close()
        try:  # bounded: a lost trainer may be hung
            acked = await asyncio.wait_for(trainer.shutdown(), timeout=cfg.launch.shutdown_timeout_s)
        except asyncio.TimeoutError:
            acked = False
        if acked:  # let torchrun end by itself: SIGTERM would leave a SignalException traceback
            await _wait_exit(procs, "trainer", cfg.launch.shutdown_timeout_s)
        await trainer.close()
        for e in engines.values():
            await e.close()
        if pool is not None:
            await pool.close()
        # last: every queued dump and checkpoint overview written (the run's work is over, the
        # loop may wait for it now; an interrupted run's cleanup above has already run)
        background.close()
    summary["reward_fn"] = ctl.reward_name
    summary["trainer_restarts"] = trainer_restarts
    summary["data_skipped_rows"] = skipped_rows(ctl.source)
    # duplicates as the run's record counts them: the one a resume reads (each step of the final lineage once)
    summary["duplicated_groups"] = duplicated_in_record(run_dir / "consumed.jsonl")
    if summary["status"] != "completed":  # stopped by a signal: the checkpoint is what matters, quickly
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (run_dir / "orchestrator_state.json").write_text(json.dumps(orch.snapshot()))
        return summary
    try:  # the trained policy for evaluation harnesses; the run's own outputs are written whatever happens here
        final_version, final_dir = export_final(run_dir, model_dir)
    except OSError as err:  # no weights to export (a model-less harness), a full disk, ...
        summary.update(hf_final=None, hf_final_version=None, hf_final_error=f"{type(err).__name__}: {err}")
        say(f"no Hugging Face export of the trained policy: {err} (`dora export` writes one from the snapshots)")
    else:
        summary.update(hf_final=str(final_dir), hf_final_version=final_version)
        say(f"trained policy (version {final_version}) as a Hugging Face directory: {final_dir}")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / "orchestrator_state.json").write_text(json.dumps(orch.snapshot()))
    if timeline is not None:
        timeline.write_chrome_trace(run_dir / "trace.json")
        try:  # a picture that cannot be drawn is reported; the trace above has every interval
            timeline.write_png(run_dir / "timeline.png", title=cfg.orchestrator.mode,
                               window_steps=obs.timeline_window_steps, warmup_steps=obs.warmup_steps)
        except (OSError, ValueError) as err:
            say(f"no timeline.png: {type(err).__name__}: {err}")
    return summary


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


async def _trainer_failure(procs: ProcessSet, err: Exception, wait_s: float = 30.0,
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


def _write_processes(run_dir: Path, procs: ProcessSet) -> None:
    """``processes.json``: the pid of the controller and of every child (rewritten after a restart)."""
    tmp = run_dir / "processes.json.tmp"
    tmp.write_text(json.dumps({"controller": os.getpid(), **{c.name: c.popen.pid for c in procs.children}}, indent=1))
    os.replace(tmp, run_dir / "processes.json")


class _SnapshotRetention:
    """Deletes per-version weight snapshots once no live version and no resumable checkpoint needs them.

    The last two checkpoints count: resume falls back to the previous one when the newest is corrupt."""

    KEEP_CHECKPOINTS = 2

    def __init__(self, run_dir: Path, live_versions) -> None:
        self.run_dir = run_dir
        self.live_versions = live_versions  # () -> the orchestrator's live versions
        self._floors: list[float] = [0]  # oldest live version at each of the last checkpoints

    @property
    def min_live_at_checkpoint(self) -> float:
        return min(self._floors)

    @min_live_at_checkpoint.setter
    def min_live_at_checkpoint(self, value: float) -> None:
        self._floors = [value]

    def checkpointed(self, version: int) -> None:
        self._floors = (self._floors + [min(self.live_versions())])[-self.KEEP_CHECKPOINTS:]

    def prune(self) -> None:
        import shutil

        keep_from = min(min(self.live_versions()), self.min_live_at_checkpoint)
        for path in (self.run_dir / "weights").glob("v*"):
            try:
                version = int(path.name[1:].split(".")[0])
            except ValueError:
                continue
            if 0 < version < keep_from:
                shutil.rmtree(path, ignore_errors=True)


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


def _clock(seconds: float) -> str:
    """``754.2 -> '12:34'`` (minutes:seconds; hours:minutes:seconds from one hour)."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="dora train", unit="step", dynamic_ncols=True)
        self.total = total
        self.t0 = time.monotonic()
        self.done = 0

    def update(self, step: int, scalars: dict[str, Any]) -> None:
        reward = scalars.get("reward/mean")
        text = (f"reward={reward:.3f} live_versions={scalars.get('versions/live')} "
                f"tok/s={scalars.get('perf/throughput_tokens_per_s') or 0:.0f}")
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:  # the tqdm bar shows its own ETA; log lines carry one computed from this run's pace
            eta = (time.monotonic() - self.t0) / self.done * max(self.total - step - 1, 0)
            log.info("step %d/%d %s eta=%s", step + 1, self.total, text, _clock(eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
