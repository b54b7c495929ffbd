"""Write the model directory and prompts of ``configs/cpu_tool_use.yaml`` (a tiny Qwen3-MoE with a
tool-calling chat template, warm-started on calculator trajectories mixed with direct answers; long
multiplications).

Usage: python tools/make_tool_use_example.py [--out example_tool_use] [--rows 512] [--warm-start-steps 120]
                                             [--direct-share 0.7] [--seed 0]

Then::

    dora train --config configs/cpu_tool_use.yaml

(:mod:`dora_megatron.models.tool_use_example` says what is written and why.)
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="example_tool_use", help="output directory (default: example_tool_use)")
    parser.add_argument("--rows", type=int, default=512, help="rows of train.parquet")
    parser.add_argument("--warm-start-steps", type=int, default=120, help="supervised steps (0: random weights)")
    parser.add_argument("--direct-share", type=float, default=None,
                        help="share of direct answers (no calculator call) in the warm start's trajectories, in "
                             "[0, 1): the warm-started policy calls its calculator in about the rest "
                             "(default: DIRECT_SHARE of dora_megatron.models.tool_use_example, 0.7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the rows and the warm start")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.warm_start_steps < 0:
        parser.error("--rows must be >= 1 and --warm-start-steps >= 0")
    if args.direct_share is not None and not 0.0 <= args.direct_share < 1.0:
        parser.error(f"--direct-share must be in [0, 1), not {args.direct_share}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dora_megatron.models.tool_use_example import DIRECT_SHARE, write_tool_use_example

    share = DIRECT_SHARE if args.direct_share is None else args.direct_share
    ex = write_tool_use_example(args.out, rows_count=args.rows, seed=args.seed, warm_start_steps=args.warm_start_steps,
                                direct_share=share, say=logging.getLogger("make_tool_use_example").info)
    sys.stdout.write(f"wrote {ex.model_dir} and {ex.data}\nnext: dora train --config configs/cpu_tool_use.yaml"
                     + ("" if args.out == "example_tool_use" else
                        f" --set model.path={ex.model_dir} --set data.path={ex.data}") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
