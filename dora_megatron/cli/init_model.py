"""``dora init-model``: write a Hugging Face model directory from a preset, optionally warm-started."""

from __future__ import annotations

import argparse
import sys

HELP = ("create a Hugging Face format Qwen3 / Qwen3-MoE model directory (random init + tokenizer.json), "
        "optionally warm-started with supervised traces of a task")
PRESET_NAMES = ("tiny-moe", "tiny-dense")


def configure(parser: argparse.ArgumentParser) -> None:
    from dora_megatron.data.tasks import DIGIT_TASKS  # pure Python, keeps `dora --help` light

    parser.add_argument("--preset", choices=PRESET_NAMES, required=True)
    parser.add_argument("--out", required=True, help="output directory (created; an existing non-empty one only with --force)")
    parser.add_argument("--force", action="store_true", help="overwrite the model files of an existing --out directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    parser.add_argument("--warm-start", choices=tuple(DIGIT_TASKS), default=None,
                        help="supervised warm start on this task after the random init (minutes on CPU)")
    parser.add_argument("--warm-start-steps", type=int, default=300, help="optimizer steps of the warm start")
    parser.add_argument("--max-len", type=int, default=40, help="longest digit list of the warm-start traces")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.warm_start_steps < 1:
        sys.stderr.write("dora init-model: --warm-start-steps must be >= 1\n")
        return 2
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        what = "a non-empty directory" if out.is_dir() else "a file"
        sys.stderr.write(f"dora init-model: --out {out} is {what}; choose a new directory or pass --force to overwrite\n")
        return 2
    from dora_megatron.models.presets import create_model_dir

    out = create_model_dir(args.preset, args.out, args.seed)
    sys.stdout.write(f"wrote {args.preset} model (seed {args.seed}) to {out}\n")
    if args.warm_start:
        from dora_megatron.models.warm_start import run_warm_start

        def say(msg: str) -> None:
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

        run_warm_start(out, args.warm_start, args.warm_start_steps, seed=args.seed, say=say,
                       task_kwargs={"min_len": 1, "max_len": args.max_len})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora init-model", description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
