"""The type of a parsed JSON answer, and reading typed fields out of one.

WHY: an engine's answer is JSON that this process did not write. Typed as ``Any`` it lets a caller
read ``answer["tokens"] + 1`` unchecked; typed as :data:`JSON` (what ``json.loads`` can return) the
type checker makes every reader narrow it first. A reader that needs fields states them once as a
msgspec ``Struct`` and :func:`read_answer` checks the answer against it, so a malformed answer
raises a :class:`~dora_megatron.comm.protocol.ProtocolError` naming the route, the field and the
value (``tokens must be an integer, got 'x'``) instead of a KeyError or a TypeError deep in the
caller.
"""

from __future__ import annotations

import json
from typing import TypeAlias, TypeVar

import msgspec

from dora_megatron.comm.protocol import ProtocolError, field_message

#: any value ``json.loads`` returns
JSON: TypeAlias = "dict[str, JSON] | list[JSON] | str | int | float | bool | None"
#: a JSON object (most answers of an engine's routes)
JSONObject: TypeAlias = "dict[str, JSON]"

_T = TypeVar("_T")


def parse_json(body: bytes) -> JSON:
    """``body`` parsed (an empty body is the empty object: SGLang answers some routes with none)."""
    if not body:
        return {}
    value: JSON = json.loads(body)  # json.loads returns only the types JSON names
    return value


def read_answer(answer: JSON, cls: type[_T], where: str) -> _T:
    """``answer`` as ``cls`` (a msgspec Struct of the fields the caller reads; other fields are
    ignored), checked strictly (no string for an int). ``where``: the route, for the error."""
    try:
        return msgspec.convert(answer, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{where}: malformed answer: {field_message(exc, answer, what='the answer')}") from None


def json_object(answer: JSON, where: str) -> JSONObject:
    """``answer`` if it is a JSON object; a :class:`ProtocolError` naming ``where`` otherwise."""
    if not isinstance(answer, dict):
        raise ProtocolError(f"{where}: the answer must be a JSON object, got {type(answer).__name__}")
    return answer
