#!/usr/bin/env python
"""Megatron-Core dist_checkpointing checkpoint (any layout) -> Hugging Face model directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--hf-config DIR] [--dtype D]

Same as ``dora convert megatron-to-hf`` (see :mod:`dora_megatron.trainer.checkpoint_convert`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dora_megatron.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
