"""``dora train``: validate the config, then launch the job (or just print the plan)."""

from __future__ import annotations

import argparse
import logging
import sys

HELP = "Run the RL job: load and validate the config, start engines, trainer and controller."

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (defaults apply to keys it omits).")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="Override one config key (repeatable), e.g. --set orchestrator.max_staleness=2.")
    parser.add_argument("--dry-run", action="store_true", help="Validate, print the resolved config and process plan, start nothing.")
    parser.add_argument("--resume", metavar="RUN_DIR", help="Continue the run in RUN_DIR from its last checkpoint.")
    parser.add_argument("--slurm-env", action="append", default=[], metavar="KEY=VALUE|@FILE",
                        help="launch.backend slurm: SLURM variables that replace the real environment (repeatable; "
                             "@FILE reads KEY=VALUE lines), e.g. --slurm-env 'SLURM_JOB_NODELIST=node[0001-1024]' "
                             "--slurm-env SLURM_GPUS_ON_NODE=8, to check a plan on a laptop with --dry-run.")
    parser.add_argument("--join", action="store_true",
                        help="launch.backend slurm: start this allocation's SGLang instances and add them to the "
                             "running job in run.run_dir (elastic pool; see slurm/elastic_join.sbatch).")
    parser.add_argument("--plan-nodes", type=int, default=0, metavar="N",
                        help="--dry-run with launch.backend slurm: list only the first N nodes in full (0 = all).")


def run(args: argparse.Namespace) -> int:
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.loader import dump_yaml
    from dora_megatron.config.schema import load_config

    config_path = args.config
    if not config_path and not args.resume and not args.dry_run:
        sys.stderr.write(_no_config_message())
        return 2
    if args.resume and not config_path:
        from pathlib import Path

        if not Path(args.resume).is_dir():
            sys.stderr.write(f"--resume {args.resume}: no such run directory\n")
            return 2
        config_path = str(Path(args.resume) / "config.yaml")
        if not Path(config_path).is_file():
            sys.stderr.write(f"--resume {args.resume}: not a run directory (no config.yaml; a run directory is what "
                             "dora train printed as 'run directory: ...')\n")
            return 2
    try:
        cfg = load_config(config_path, args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"config error: {err}\n")
        return 2
    if cfg.launch.backend == "slurm":
        return _run_slurm(cfg, args)
    if args.dry_run:
        from dora_megatron.launch.inputs import input_problem
        from dora_megatron.launch.plan import format_plan, local_plan

        problem = input_problem(cfg)
        if problem:
            sys.stderr.write(f"dora train: {problem}\n")
            return 2

        sys.stdout.write("# resolved config\n")
        sys.stdout.write(dump_yaml(cfg))
        model_dir = cfg.model.path or "<run_dir>/model"
        sys.stdout.write(format_plan(local_plan(cfg, model_dir, "<run_dir>")) + "\n")
        sys.stdout.write(_memory_table(cfg) + "\n")
        return 0
    from dora_megatron.launch.local import run_local_job

    return run_local_job(cfg, resume=args.resume)


def _configs_dir():
    """The job configs a user can start from: ``./configs`` (a checkout's root), else the one next to
    the installed package (an editable install); None when neither exists (a wheel)."""
    from pathlib import Path

    for d in (Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"):
        if d.is_dir() and any(d.glob("*.yaml")):
            return d
    return None


def _no_config_message() -> str:
    """WHY refuse a bare ``dora train``: without ``--config`` the built-in defaults would start a
    20-step job nobody chose; the message lists the job configs (each with its first comment line)
    so the next command is one copy away, and says how to see what the defaults would run."""
    import os

    d = _configs_dir()
    lines = []
    if d is None:
        lines.append("dora train: no --config given; choose a job config (YAML; docs/configuration.md lists every "
                     "key; no configs/ folder here: the examples are in a dora_megatron checkout's configs/)")
    else:
        rel = os.path.relpath(d)
        shown = d if rel.startswith("..") else rel
        paths = sorted(d.glob("*.yaml"))
        example = next((p for p in paths if p.name == "cpu_tiny.yaml"), paths[0])
        lines.append(f"dora train: no --config given; choose a job config, e.g. dora train --config "
                     f"{os.path.join(shown, example.name)}")
        lines.append(f"job configs in {shown}/ (the simulator's, for dora simulate, are in {os.path.join(shown, 'sim')}/):")
        width = max(len(os.path.join(shown, p.name)) for p in paths)
        for path in paths:
            first = next((ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
            lines.append(f"  {os.path.join(shown, path.name):<{width}}  {first}".rstrip())
    lines.append("dora train --dry-run (without --config) prints what the built-in defaults would run; "
                 "--resume RUN_DIR continues a run with its own config")
    return "\n".join(lines) + "\n"


def _run_slurm(cfg, args: argparse.Namespace) -> int:
    """``launch.backend: slurm``: plan from the SLURM environment (or ``--slurm-env``), print or run it."""
    import os

    from dora_megatron.config.loader import dump_yaml
    from dora_megatron.launch.cluster import PlanError, check_plan, format_cluster_plan, slurm_plan
    from dora_megatron.launch.slurm import SlurmEnvError, parse_env_overrides, read_slurm_env, slurm_run_dir

    try:
        fake = parse_env_overrides(args.slurm_env)
        env = read_slurm_env(fake if fake else os.environ)
        run_dir = args.resume or slurm_run_dir(cfg, env)  # a resumed job continues in the directory it resumes
        model_dir = cfg.model.path or f"{run_dir}/model"
        plan = slurm_plan(cfg, env, model_dir, run_dir, join=args.join)
    except (SlurmEnvError, PlanError, OSError) as err:
        sys.stderr.write(f"slurm plan error: {err}\n")
        return 2
    problems = check_plan(plan, cfg.cluster.gpus_per_node or env.gpus_per_node or 0)
    if args.dry_run:
        from dora_megatron.launch.layout import trainer_layout_problem

        trainer_problem = trainer_layout_problem(cfg)  # the run itself checks it with the model's inputs
        if trainer_problem:
            problems.append(trainer_problem)
        sys.stdout.write("# resolved config\n")
        sys.stdout.write(dump_yaml(cfg))
        sys.stdout.write(format_cluster_plan(plan, args.plan_nodes or None) + "\n")
        sys.stdout.write(_memory_table(cfg) + "\n")
        for p in problems:
            sys.stdout.write(f"PLAN PROBLEM: {p}\n")
        sys.stdout.write(f"plan check: {'OK' if not problems else f'{len(problems)} problem(s)'}\n")
        return 0 if not problems else 2
    if problems:
        sys.stderr.write("slurm plan is inconsistent:\n" + "\n".join(problems) + "\n")
        return 2
    from dora_megatron.launch.slurm_run import run_join_node, run_slurm_node

    if args.join:
        return run_join_node(cfg, env, plan)
    return run_slurm_node(cfg, env, plan, resume=args.resume)


def _memory_table(cfg) -> str:
    """The trainer's per-rank memory estimate (:mod:`dora_megatron.trainer.memory`) for the dry run."""
    from dora_megatron.launch.layout import memory_estimate
    from dora_megatron.trainer.memory import format_estimate

    est = memory_estimate(cfg)
    if est is None:
        return (f"trainer memory estimate: no config.json at model.path {cfg.model.path} (the dry run reads only "
                "that file; e.g. --set model.path=configs/models/Qwen3-30B-A3B)")
    return format_estimate(est, cfg.cluster.gpu_memory_gb if cfg.trainer.device == "cuda" else 0.0)
