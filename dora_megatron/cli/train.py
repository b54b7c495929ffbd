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


def run(args: argparse.Namespace) -> int:
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.loader import dump_yaml
    from dora_megatron.config.schema import load_config

    config_path = args.config
    if args.resume and not config_path:
        from pathlib import Path

        config_path = str(Path(args.resume) / "config.yaml")
    try:
        cfg = load_config(config_path, args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"config error: {err}\n")
        return 2
    if args.dry_run:
        from dora_megatron.launch.plan import format_plan, local_plan

        sys.stdout.write("# resolved config\n")
        sys.stdout.write(dump_yaml(cfg))
        model_dir = cfg.model.path or "<run_dir>/model"
        sys.stdout.write(format_plan(local_plan(cfg, model_dir, "<run_dir>")) + "\n")
        return 0
    try:
        from dora_megatron.launch.local import run_local_job
    except ModuleNotFoundError as err:
        if err.name == "dora_megatron.launch.local":
            sys.stderr.write("dora train: launching is not available yet in this build (use --dry-run)\n")
            return 3
        raise
    return run_local_job(cfg, resume=args.resume)
