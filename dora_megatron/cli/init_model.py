"""``dora init-model``: write a randomly initialised HF model directory from a preset."""

from __future__ import annotations

import argparse

HELP = "create a Hugging Face format Qwen3 / Qwen3-MoE model directory (random init + tokenizer.json)"
PRESET_NAMES = ("tiny-moe", "tiny-dense")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESET_NAMES, required=True)
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")


def run(args: argparse.Namespace) -> int:
    from dora_megatron.models.presets import create_model_dir

    out = create_model_dir(args.preset, args.out, args.seed)
    print(f"wrote {args.preset} model (seed {args.seed}) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora init-model", description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
