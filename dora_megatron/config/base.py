"""Shared machinery for typed, strictly-loaded configuration sections.

Every config section is a plain ``@dataclass`` whose fields are declared with
:func:`field_doc`. The field metadata carries the human documentation (used to
generate the config reference, docs/configuration.md) and simple declarative range rules
(``ge``, ``gt``, ``le``, ``choices``) that the loader checks generically, so each
section only writes code for genuinely cross-field rules in an optional
``check(self, path: str) -> None`` method that raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A configuration problem; the message always names the offending key path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def field_doc(
    default: Any = _MISSING,
    doc: str = "",
    *,
    default_factory: Any = _MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    unit: str | None = None,
) -> Any:
    """Declare a documented config field with optional declarative range rules."""
    metadata = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": tuple(choices) if choices is not None else None,
        "unit": unit,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
