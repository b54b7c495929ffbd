"""Regenerate the config reference in docs/configuration.md from the config dataclasses.

WHY argparse for a tool without options to speak of: ``--help`` (or a mistyped flag) must answer,
not rewrite the documentation; ``--check`` lets a script ask whether the reference is current.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dora_megatron.config.docs import REFERENCE_FILE, render_reference, replace_block, write_reference

log = logging.getLogger("gen_config_docs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/gen_config_docs.py",
        description=f"Rewrite the config reference of {REFERENCE_FILE} (the block between its config-reference "
                    "markers) from the config dataclasses; the text around the block is kept.")
    parser.add_argument("--check", action="store_true",
                        help=f"write nothing; exit 1 when {REFERENCE_FILE} is stale, 0 when it is current")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(__file__).resolve().parent.parent / REFERENCE_FILE
    if args.check:
        text = path.read_text()
        if replace_block(text, render_reference()) != text:
            log.error("%s: config reference is stale (run python tools/gen_config_docs.py)", REFERENCE_FILE)
            return 1
        log.info("%s: config reference is current", REFERENCE_FILE)
        return 0
    if write_reference(path):
        log.info("%s: config reference updated", REFERENCE_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
