"""``dora bench``: every rollout mode on the same workload, real processes, side by side."""

from __future__ import annotations

import argparse
import sys

HELP = ("Run every rollout mode (sync, one_step_off, partial, dora) on the same workload and compare them, "
        "and with the rollout and training capacity measured alone (the bound).")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/bench/cpu_longtail.yaml).")
    parser.add_argument("--out", required=True, help="Output directory: bench.json, bench.md, reward.png, overview.png, runs/.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="Override one config key (repeatable), e.g. --set bench.seeds=3.")


def run(args: argparse.Namespace) -> int:
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.bench import run_bench
    from dora_megatron.launch.inputs import input_problem

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"config error: {err}\n")
        return 2
    problem = input_problem(cfg)
    if problem:
        sys.stderr.write(f"dora bench: {problem}\n")
        return 2
    try:
        run_bench(cfg, args.out)
    except (RuntimeError, ConfigError) as err:
        sys.stderr.write(f"dora bench failed: {err}\n")
        return 1
    return 0
