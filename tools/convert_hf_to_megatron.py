#!/usr/bin/env python
"""Hugging Face model directory -> Megatron-Core dist_checkpointing checkpoint in a TP/PP/EP layout.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N] [--pp N] [--ep N]
                                           [--first-stage-layers N] [--last-stage-layers N]

Same as ``dora convert hf-to-megatron`` (see :mod:`dora_megatron.trainer.checkpoint_convert`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dora_megatron.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
