"""The ``dora`` console script: one subcommand per job, dispatched lazily.

Each subcommand is a module ``dora_megatron.cli.<name>`` exposing ``HELP``,
``configure(parser)`` and ``run(args) -> int``, whose top level imports only the
standard library; torch and megatron load inside ``run``. That keeps
``dora --help`` fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType
from typing import Sequence

#: Subcommands of DESIGN section 11, in the order ``--help`` lists them.
SUBCOMMANDS: dict[str, str] = {
    "train": "Run the RL job (all processes on this machine, or this node's roles in a SLURM job).",
    "serve": "Serve one embedded rollout engine over SGLang's HTTP protocol.",
    "init-model": "Create a tiny Hugging Face format model directory locally.",
    "simulate": "Run the orchestrator against simulated instances on a virtual clock.",
    "bench": "Run every rollout mode on the same workload and compare them.",
    "convert": "Convert checkpoints between Hugging Face and Megatron formats.",
    "export": "Write a version of a run as a Hugging Face model directory with its tokenizer.",
}


def _module_for(name: str) -> ModuleType:
    return importlib.import_module(f"dora_megatron.cli.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dora",
        description="dora_megatron: asynchronous RL with multi-version streaming rollout (DORA).",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in SUBCOMMANDS.items():
        module = _module_for(name)
        p = sub.add_parser(name, help=getattr(module, "HELP", summary), description=getattr(module, "HELP", summary))
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
