"""``dora export RUN_DIR [--version N] --out DIR``: a kept version of a run as a Hugging Face directory.

The directory holds the version's weights and ``config.json`` plus the source model's tokenizer
files, chat template and generation config (:func:`dora_megatron.weights.export.export_hf`), so
``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load it as it is. Every run writes
its newest version to ``RUN_DIR/hf_final`` by itself; this command is for the others.
"""

from __future__ import annotations

import argparse
import sys

HELP = "write a kept version of a run (default: the newest) as a Hugging Face model directory with its tokenizer"
DTYPES = ("float32", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory dora train printed")
    parser.add_argument("--version", type=int, default=None,
                        help="version to export (0 = the source model; default: the newest kept)")
    parser.add_argument("--out", help="directory to write (replaced if present); required unless --list")
    parser.add_argument("--model", default=None,
                        help="the source model directory whose tokenizer, chat template and generation config are "
                             "copied (default: the run's model.path, or RUN_DIR/model for presets)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights (default: as trained)")
    parser.add_argument("--list", action="store_true", help="list the kept versions and exit")


def source_model(run_dir, model: str | None):
    """The run's source model directory: ``--model``, its ``model.path``, or ``RUN_DIR/model``."""
    from pathlib import Path

    if model:
        return Path(model)
    from dora_megatron.config.loader import yaml_load

    config = run_dir / "config.yaml"
    path = ((yaml_load(config.read_text()) or {}).get("model") or {}).get("path") if config.is_file() else ""
    if path and Path(path).is_dir():
        return Path(path)
    if (run_dir / "model" / "config.json").is_file():
        return run_dir / "model"
    raise FileNotFoundError(f"cannot find the source model of {run_dir} (model.path {path!r} is not a directory "
                            "from here): pass --model DIR")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dora_megatron.weights.export import export_hf, kept_versions, version_weights

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        sys.stderr.write(f"dora export: {run_dir}: no such run directory\n")
        return 2
    versions = kept_versions(run_dir)
    if args.list:
        sys.stdout.write(" ".join(map(str, versions)) + "\n")
        return 0
    if not args.out:
        sys.stderr.write("dora export: --out DIR is required (or --list)\n")
        return 2
    version = versions[-1] if args.version is None else args.version
    try:
        model_dir = source_model(run_dir, args.model)
        out = export_hf(version_weights(run_dir, model_dir, version), model_dir, Path(args.out), version=version,
                        dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        sys.stderr.write(f"dora export: {err}\n")
        return 1
    sys.stdout.write(f"wrote version {version} of {run_dir} to {out}\n")
    return 0
