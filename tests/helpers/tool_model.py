"""The own model (:mod:`tests.helpers.own_model`) with a Qwen3-style tool-calling chat template.

What a user of a Qwen3 checkpoint has: ``tools=`` are listed in the system turn inside ``<tools>``,
the model answers with ``<tool_call>`` blocks, and consecutive ``tool`` messages are rendered
together as one user turn of ``<tool_response>`` blocks. ``<tool_call>`` / ``</tool_call>`` are
added (non-special) tokens, as in Qwen3's tokenizer. Written for these tests (not Qwen's file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tool_model_dir(own_model_dir: str | Path, out: str | Path) -> Path:
    """A copy of the own model's directory whose tokenizer has :data:`TOOL_TEMPLATE` and the
    ``<tool_call>`` tokens (the model's vocabulary is padded past the tokenizer: the ids fit)."""
    from transformers import AutoTokenizer

    out = Path(out)
    shutil.copytree(own_model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out
