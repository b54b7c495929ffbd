"""``dora convert``: Hugging Face <-> Megatron-Core ``dist_checkpointing`` checkpoints.

Two forms, the same code as ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``
(:mod:`dora_megatron.trainer.checkpoint_convert`)::

    dora convert hf-to-megatron --hf DIR --out DIR [--tp N] [--pp N] [--ep N]
                                [--first-stage-layers N] [--last-stage-layers N]
    dora convert megatron-to-hf --ckpt DIR --out DIR [--hf-config DIR] [--dtype D]

``hf-to-megatron`` starts ``tp * pp * ep`` gloo ranks (CPU) and writes the checkpoint in that layout;
``megatron-to-hf`` reads a checkpoint of any layout (also a trainer checkpoint, with ``--hf-config``).
``--first-stage-layers`` / ``--last-stage-layers`` split the pipeline unevenly (Megatron's
``num_layers_in_first/last_pipeline_stage``, as ``trainer.megatron`` takes them).
"""

from __future__ import annotations

import argparse
import sys

HELP = "convert checkpoints between Hugging Face (safetensors) and Megatron-Core dist_checkpointing, any TP/PP/EP layout"
DTYPES = ("float32", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    from dora_megatron.trainer import checkpoint_convert

    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF model directory -> dist_checkpointing checkpoint in a TP/PP/EP layout")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to create (must be empty or absent)")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the written checkpoint")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (layers split evenly unless "
                   "--first-stage-layers / --last-stage-layers say otherwise)")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE only)")
    checkpoint_convert.add_split_arguments(a)
    b = sub.add_parser("megatron-to-hf", help="dist_checkpointing checkpoint (any layout) -> HF model directory")
    b.add_argument("--ckpt", required=True, help="checkpoint directory (from hf-to-megatron or the trainer)")
    b.add_argument("--out", required=True, help="HF directory to write (replaced if present)")
    b.add_argument("--hf-config", default=None,
                   help="HF directory whose config.json/tokenizer to use (default: the copy kept by hf-to-megatron; "
                        "required for trainer checkpoints)")
    b.add_argument("--dtype", choices=DTYPES, default=None, help="dtype of the written tensors (default: the config's)")
    b.add_argument("--tp", type=int, default=1, help="layout to read in (default one rank; any layout reshards)")
    b.add_argument("--pp", type=int, default=1)
    b.add_argument("--ep", type=int, default=1)
    checkpoint_convert.add_split_arguments(b)


def run(args: argparse.Namespace) -> int:
    from dora_megatron.trainer import checkpoint_convert

    for k in ("tp", "pp", "ep"):
        if getattr(args, k) < 1:
            sys.stderr.write(f"dora convert: --{k} must be >= 1\n")
            return 2
    from pathlib import Path

    from dora_megatron.launch.layout import layout_problems, read_hf_config

    # the model's config.json: the HF directory, or the one the conversion reads the checkpoint with
    model_dir = args.hf if args.direction == "hf-to-megatron" else (
        args.hf_config or str(Path(args.ckpt) / checkpoint_convert.HF_META_DIR))
    hf_config = read_hf_config(model_dir)
    split = checkpoint_convert.PipelineSplitArgs.from_args(args)
    uneven = bool(split.megatron())
    problems = layout_problems(hf_config, args.tp, args.pp, args.ep, prefix="--", even_pp=not uneven) \
        if hf_config else []
    if hf_config:  # a model the trainer cannot build (an unsupported model_type, ...): named here, not by a rank
        from dora_megatron.models.hf_config import spec_from_dict

        try:
            arch = spec_from_dict(hf_config, where="config.json")
            problems = arch.trainer_problems() + problems
        except ValueError as err:
            problems = [str(err)] + problems
        else:
            if uneven and not problems:  # the split, by Megatron's rules, before any rank starts
                problems += _split_problems(arch, args, split)
    if problems:  # before any rank starts (Megatron would say it only inside torchrun's failure banner)
        sys.stderr.write(f"dora convert: {'; '.join(problems)} ({model_dir})\n")
        return 2
    try:
        if args.direction == "hf-to-megatron":
            out = checkpoint_convert.hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.ep, split=split)
            sys.stdout.write(f"wrote Megatron checkpoint (tp={args.tp} pp={args.pp} ep={args.ep}) to {out}\n")
        else:
            out = checkpoint_convert.megatron_to_hf(args.ckpt, args.out, args.hf_config, args.tp, args.pp, args.ep,
                                                    args.dtype, split=split)
            sys.stdout.write(f"wrote Hugging Face model to {out}\n")
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        sys.stderr.write(f"dora convert: {exc}\n")
        return 1
    return 0


def _split_problems(arch, args: argparse.Namespace, split) -> list[str]:
    """Why the uneven split of ``--first-stage-layers`` / ``--last-stage-layers`` cannot hold the
    model (empty: it can), named by the options."""
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.trainer.pipeline_split import trainer_split

    cfg = TrainerConfig(tp=args.tp, pp=args.pp, ep=args.ep, device="cpu", megatron=split.megatron())
    try:
        trainer_split(arch, cfg, names={"num_layers_in_first_pipeline_stage": "--first-stage-layers",
                                        "num_layers_in_last_pipeline_stage": "--last-stage-layers"})
    except ValueError as err:
        return [str(err)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora convert", description=HELP)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
