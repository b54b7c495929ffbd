"""Regenerate the config reference in docs/configuration.md from the config dataclasses."""

from __future__ import annotations

import sys
from pathlib import Path

from dora_megatron.config.docs import REFERENCE_FILE, write_reference


def main() -> int:
    path = Path(__file__).resolve().parent.parent / REFERENCE_FILE
    if write_reference(path):
        sys.stderr.write(f"{REFERENCE_FILE}: config reference updated\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
