"""Generate the config reference (``docs/configuration.md``) from the dataclass field docs.

The part of ``docs/configuration.md`` between ``<!-- config-reference:start -->`` and
``<!-- config-reference:end -->`` is produced by :func:`render_reference`; a
test fails when it is stale, so the documentation cannot drift from the code.
Regenerate with ``python tools/gen_config_docs.py`` (:func:`write_reference`).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

#: the file that holds the reference, relative to the repository root
REFERENCE_FILE = "docs/configuration.md"
START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def _type_str(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _rules(meta: dict) -> str:
    parts = []
    for key, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if meta.get(key) is not None:
            parts.append(f"{sym} {meta[key]}")
    if meta.get("choices"):
        parts.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    return "; ".join(parts)


def render_section(name: str, cls: type) -> str:
    hints = typing.get_type_hints(cls)
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
    lines = [f"#### `{name}`" + (f": {doc}" if doc else ""), "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        meta = dict(f.metadata or {})
        text = str(meta.get("doc", "")).replace("|", "\\|").replace("\n", " ")
        rules = _rules(meta)
        if meta.get("unit"):
            text += f" [{meta['unit']}]"
        if rules:
            text += f" ({rules})"
        type_text = _type_str(hints[f.name]).replace("|", "\\|")  # `bool | None` must not split the row
        lines.append(f"| `{name}.{f.name}` | {type_text} | `{default!r}` | {text} |")
    removed = getattr(cls, "REMOVED_KEYS", {})
    if removed:  # refused at load unless at their old, inert default (see loader.from_dict)
        lines.append("")
        lines.extend(f"- removed `{name}.{key}`: {why}." for key, (_, why) in sorted(removed.items()))
    return "\n".join(lines)


def render_reference(root: type | None = None) -> str:
    if root is None:
        from dora_megatron.config.schema import DoraConfig

        root = DoraConfig
    hints = typing.get_type_hints(root)
    sections = [render_section(f.name, hints[f.name]) for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])]
    return "\n\n".join(sections)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"no config-reference markers ({START} ... {END}) in the text")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


def write_reference(path: str | Path, root: type | None = None) -> bool:
    """Rewrite the reference between the markers of ``path`` from the config classes; returns
    whether the file changed (False: it was current)."""
    path = Path(path)
    text = path.read_text()
    new = replace_block(text, render_reference(root))
    if new == text:
        return False
    path.write_text(new)
    return True
