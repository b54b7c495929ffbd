"""Write a model directory and a prompt set shaped like a user's own, for ``configs/cpu_own_model.yaml``.

Usage: python tools/make_example_model.py [--out example_own] [--rows 256] [--seed 0] [--family qwen3_moe]

``OUT/model``: a tiny model of ``--family`` (a supported ``model_type``: qwen3, qwen3_moe, qwen2_moe,
mixtral, glm4_moe, deepseek_v3) saved by transformers (bf16) with a byte-level BPE tokenizer,
``<|im_start|>`` / ``<|im_end|>``, a Qwen-style chat template and ``generation_config.json``;
``OUT/train.parquet``: DAPO-shaped rows (chat-list ``prompt`` with system + user,
``reward_model.ground_truth``, ``data_source``, ``extra_info``). The reward file that goes with it
is ``examples/own_model/reward.py``. Then::

    dora train --config configs/cpu_own_model.yaml
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="example_own", help="output directory (default: example_own)")
    parser.add_argument("--rows", type=int, default=256, help="rows of train.parquet")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the rows")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="dtype of the saved weights")
    from dora_megatron.models.families import SUPPORTED_MODEL_TYPES

    parser.add_argument("--family", default="qwen3_moe", choices=SUPPORTED_MODEL_TYPES,
                        help="model_type of the tiny model (default: qwen3_moe)")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be >= 1")
    from dora_megatron.models.example import write_example

    paths = write_example(args.out, rows=args.rows, seed=args.seed, dtype=args.dtype, family=args.family)
    sys.stdout.write(f"wrote {paths.model_dir} ({args.family}, tokenizer, chat template, generation config) and "
                     f"{paths.data} ({args.rows} rows)\n"
                     "next: dora train --config configs/cpu_own_model.yaml"
                     + ("" if args.out == "example_own" else
                        f" --set model.path={paths.model_dir} --set data.path={paths.data}") + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
