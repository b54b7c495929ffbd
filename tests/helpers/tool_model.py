"""The own model (:mod:`tests.helpers.own_model`) with a Qwen3-style tool-calling chat template.

What a user of a Qwen3 checkpoint has: ``tools=`` are listed in the system turn inside ``<tools>``,
the model answers with ``<tool_call>`` blocks, and consecutive ``tool`` messages are rendered
together as one user turn of ``<tool_response>`` blocks. ``<tool_call>`` / ``</tool_call>`` are
added (non-special) tokens, as in Qwen3's tokenizer. The template is the tool-use example's
(:mod:`dora_megatron.models.tool_use_example`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dora_megatron.models.tool_use_example import TOOL_TEMPLATE, add_tool_template  # noqa: F401 - re-exported


def tool_model_dir(own_model_dir: str | Path, out: str | Path) -> Path:
    """A copy of the own model's directory whose tokenizer has :data:`TOOL_TEMPLATE` and the
    ``<tool_call>`` tokens (the model's vocabulary is padded past the tokenizer: the ids fit)."""
    from transformers import AutoTokenizer

    out = Path(out)
    shutil.copytree(own_model_dir, out)
    add_tool_template(AutoTokenizer.from_pretrained(str(out))).save_pretrained(str(out))
    return out
