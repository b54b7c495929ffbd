"""Regenerate the config reference block of README.md from the config dataclasses."""

from __future__ import annotations

import sys
from pathlib import Path

from dora_megatron.config.docs import render_reference, replace_block


def main() -> int:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    text = readme.read_text()
    new = replace_block(text, render_reference())
    if new != text:
        readme.write_text(new)
        sys.stderr.write("README.md config reference updated\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
