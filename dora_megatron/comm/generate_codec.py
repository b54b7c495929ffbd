"""Decoding a ``/generate`` answer, off the event loop when it is big.

WHY: at reasoning lengths one answer is thousands of tokens (a 30K-token answer is ~1 MB of JSON,
and with routed experts of a 48-layer top-8 MoE another ~60 MB of base64), and a controller
receives thousands of them per step. Parsed on the event loop, a burst of them held it for seconds
(``docs/results/controller_scale.md``), delaying every dispatch, stats poll and weight switch.
Here an answer above :data:`BIG_ANSWER_BYTES` is decoded in a worker thread: the routed experts'
base64 is cut out of the raw bytes first and decoded in slices (the JSON parser never scans it,
and no single call holds the GIL for long) into the smallest integer array that holds the expert
ids; the per-token log-probs are parsed as one flat list (:func:`split_logprobs`: no Python list
per token for the garbage collector to count); the rest is parsed with orjson (several times
faster than ``json``). ``raw["meta_info"]["output_token_logprobs"]`` is then None: the log-probs
are ``output_token_logprobs``. A malformed answer raises
:class:`~dora_megatron.comm.protocol.ProtocolError` naming the field.
"""

from __future__ import annotations

import asyncio
import binascii
import json
from array import array
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import msgspec
import numpy as np

from dora_megatron.comm.batch_files import expert_dtype
from dora_megatron.comm.json_value import JSON
from dora_megatron.comm.protocol import GenerateResponse, ProtocolError, field_message

_loads: Callable[[bytes], JSON]  # orjson's and json's loads both return only what JSON names
try:
    import orjson

    _loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    _loads = json.loads
    _JSONError = (json.JSONDecodeError,)

#: answers above this many bytes are decoded in a worker thread (below, the thread hop costs more)
BIG_ANSWER_BYTES = 8 * 1024
#: base64 characters decoded per call (rounded down to a multiple of 16: 12 bytes, 3 whole int32
#: ids): the GIL is free between two slices, and a slice's int32 copy is the largest transient
B64_SLICE = 4 << 20
_ROUTED_KEY = b'"routed_experts"'
_LOGPROBS_KEY = b'"output_token_logprobs"'


def split_routed(body: bytes) -> tuple[bytes, memoryview | None]:
    """``body`` with ``meta_info.routed_experts``' text replaced by ``null``, and that text as a view
    into ``body`` (no copy of the ~60 MB of a long answer; None: the answer carries none as a
    string)."""
    at = body.find(_ROUTED_KEY)
    while at > 0 and body[at - 1:at] == b"\\":  # an escaped quote: the key inside a string, not a key
        at = body.find(_ROUTED_KEY, at + 1)
    if at < 0:
        return body, None
    j = at + len(_ROUTED_KEY)
    while body[j:j + 1] in (b" ", b":", b"\n", b"\t", b"\r"):
        j += 1
    if body[j:j + 1] != b'"':  # null or not a string: the JSON parser and the checks below see it
        return body, None
    end = body.find(b'"', j + 1)
    if end < 0:
        raise ProtocolError("meta_info.routed_experts: unterminated string")
    return body[:j] + b"null" + body[end + 1:], memoryview(body)[j + 1:end]


def _value_start(body: bytes, key: bytes) -> int:
    """Where the value of object key ``key`` (quoted) starts in ``body`` (-1: no such key). An
    escaped quote before it is the key's text inside a string, not a key."""
    at = body.find(key)
    while at > 0 and body[at - 1:at] == b"\\":
        at = body.find(key, at + 1)
    if at < 0:
        return -1
    j = at + len(key)
    while body[j:j + 1] in (b" ", b"\n", b"\t", b"\r"):
        j += 1
    if body[j:j + 1] != b":":
        return -1
    j += 1
    while body[j:j + 1] in (b" ", b"\n", b"\t", b"\r"):
        j += 1
    return j


def split_logprobs(body: bytes) -> tuple[bytes, list[float]] | None:
    """``body`` with ``meta_info.output_token_logprobs`` replaced by ``null``, and the log-probs
    (the first item of each ``[logprob, token_id, text]``); None when the fast path does not apply
    (no such list, an item that is not three numbers-or-null, text present): the caller parses the
    whole answer then, which names the malformed field.

    WHY: parsed as JSON, the list is one small Python list per token; at reasoning lengths
    thousands per answer, each counted by the garbage collector, so the answers of a busy
    controller triggered collections that scan every object it holds (hundreds of thousands at
    4,096 requests in flight): about three times the parse's own CPU when it was measured. Here
    its brackets are dropped and the numbers parsed as one flat list (no container per token)."""
    j = _value_start(body, _LOGPROBS_KEY)
    if j < 0 or body[j:j + 1] != b"[":
        return None
    if body[j:j + 2] == b"[]":
        return body[:j] + b"null" + body[j + 2:], []
    end = body.find(b"]]", j)
    if end < 0:
        return None
    text = body[j + 1:end + 1]  # [a, b, null], [c, d, null]
    if b'"' in text:  # the tokens' text (return_text_in_logprobs): brackets may hide in strings
        return None
    items = text.count(b"[")
    try:
        flat = _loads(b"[" + text.translate(None, b"[]") + b"]")
        # each item exactly [number, integer, null]: otherwise the whole answer is parsed
        if (not isinstance(flat, list) or len(flat) != 3 * items or text.count(b"null]") != items
                or flat[2::3].count(None) != items):
            return None
        # WHY casts: array() checks the items' types itself, once per token in C (TypeError otherwise)
        array("q", cast(list[int], flat[1::3]))
        logprobs = array("d", cast(list[float], flat[0::3])).tolist()
    except _JSONError:
        return None
    except (TypeError, OverflowError):
        return None
    return body[:j] + b"null" + body[end + 2:], logprobs


def _b64_slice(view: memoryview, i: int, step: int) -> bytes:
    try:
        return binascii.a2b_base64(view[i:i + step], strict_mode=True)
    except binascii.Error as err:
        raise ProtocolError(f"meta_info.routed_experts is not base64 (at character {i} or after): {err}") from None


def decode_routed(text: bytes | memoryview) -> np.ndarray:
    """SGLang's base64 of little-endian int32 expert ids -> a flat array of the smallest signed
    integer type that holds them (int8 up to 127 experts: 1 byte an id, not 4).

    WHY slice by slice into the result: a 30K-token answer of a 48-layer top-8 MoE is ~60 MB of
    base64, ~46 MB as int32 and ~12 MB as int8. Decoded whole (then cast) the answer-sized int32
    copy and the joined bytes were transients that glibc's dynamic mmap threshold left in the heap
    once freed: the controller's RSS grew to twice the bytes it held and more, when it was measured.
    Here each :data:`B64_SLICE` of the text (a view, not a copy) is decoded and cast straight into
    the result, whose type is widened (once per width) only when a later slice holds a larger id,
    so the transients are a slice's and the result is the same array the whole decode gave."""
    view = memoryview(text)
    if len(view) % 4:
        raise ProtocolError(f"meta_info.routed_experts: {len(view)} base64 characters, not a multiple of 4")
    pad = bytes(view[-2:]).count(b"=") if len(view) else 0
    n_bytes = len(view) // 4 * 3 - pad
    step = max(16, B64_SLICE // 16 * 16)
    if n_bytes % 4:
        for i in range(0, len(view), step):  # text that is not base64 is named as such first
            _b64_slice(view, i, step)
        raise ProtocolError(f"meta_info.routed_experts: {n_bytes} bytes, not a whole number of int32 ids")
    out = np.empty(n_bytes // 4, dtype=expert_dtype(1))
    top, at = 0, 0  # the largest id so far (ids 0 .. top fit out's type), the ids written
    for i in range(0, len(view), step):
        raw = _b64_slice(view, i, step)
        if len(raw) != min(step, len(view) - i) // 4 * 3 - (pad if i + step >= len(view) else 0):
            raise ProtocolError(f"meta_info.routed_experts: '=' padding before the text's end (at character {i} or after)")
        ids = np.frombuffer(raw, dtype="<i4")
        if ids.size and int(ids.max()) > top:
            top = int(ids.max())
            if expert_dtype(top + 1) != out.dtype:
                out = out.astype(expert_dtype(top + 1))
        out[at:at + ids.size] = ids  # the cast of the whole decode (``astype``: wraps ids below the type's minimum)
        at += ids.size
    return out


def _bad_item(values: list[JSON], ok: Callable[[JSON], bool]) -> int:
    return next(i for i, v in enumerate(values) if not ok(v))


@dataclass
class _Answer:
    """The parts of a ``/generate`` answer :func:`parse_generate` reads before
    :meth:`GenerateResponse.from_json`: their types are checked by msgspec (null: none)."""

    output_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None


def parse_generate(body: bytes) -> GenerateResponse:
    """A ``/generate`` answer's bytes -> :class:`GenerateResponse` (``raw["meta_info"]["routed_experts"]``
    decoded to an integer array). Raises :class:`ProtocolError` naming the malformed field."""
    if not body:
        return GenerateResponse.from_json({})
    body, routed = split_routed(body)
    fast, d = split_logprobs(body), None
    if fast is not None:
        try:
            d = _loads(fast[0])
        except _JSONError:
            fast = None  # cut in the wrong place: the whole answer is parsed below
    if fast is None:
        try:
            d = _loads(body)
        except _JSONError as err:
            raise ProtocolError(f"/generate answer is not JSON: {err}") from None
    try:  # the ids checked (an int each, no bool) and copied by msgspec in one pass; meta_info's values are not walked
        shape = msgspec.convert(d, _Answer, strict=True)
    except msgspec.ValidationError as err:
        raise ProtocolError(field_message(err, d, what="/generate answer")) from None
    d = cast(dict[str, JSON], d)  # an object: msgspec said so
    ids = shape.output_ids or []
    meta = shape.meta_info or {}
    lps, logprobs = meta.get("output_token_logprobs"), None
    if fast is not None:  # cut out and parsed flat (None in ``raw``)
        logprobs = fast[1]
        if len(logprobs) != len(ids):
            raise ProtocolError(f"meta_info.output_token_logprobs has {len(logprobs)} entries for {len(ids)} output_ids")
    elif lps is not None:
        if not isinstance(lps, list):
            raise ProtocolError("meta_info.output_token_logprobs must be a list of [logprob, token_id, text]")
        try:
            # WHY a cast: this loop runs once per output token, so the entries' shape is checked by
            # the exceptions below (then _bad_item names the entry), not by an isinstance per token
            logprobs = [float(x[0]) for x in cast(list[Sequence[float]], lps)]
        except (TypeError, ValueError, IndexError, KeyError):
            i = _bad_item(lps, lambda x: isinstance(x, list) and bool(x) and isinstance(x[0], (int, float)))
            raise ProtocolError(f"meta_info.output_token_logprobs[{i}] must be [logprob, token_id, text], "
                                f"got {str(lps[i])[:80]}") from None
        if len(lps) != len(ids):
            raise ProtocolError(f"meta_info.output_token_logprobs has {len(lps)} entries for {len(ids)} output_ids")
    answer: Mapping[str, object] = d  # the JSON answer, and below the decoded routed experts (an array) in it
    if routed is not None:
        try:
            experts = decode_routed(routed)
        except ProtocolError as err:  # the sample named: the caller reports only the instance
            raise ProtocolError(f"the answer to {meta.get('id')!r}: {err}") from None
        answer = {**d, "meta_info": {**meta, "routed_experts": experts}}
    resp = GenerateResponse.from_json(answer)
    resp.output_token_logprobs = logprobs
    resp.token_arrays = token_arrays(ids, logprobs)  # each checked an int above
    return resp


def token_arrays(ids: list[int], logprobs: list[float] | None) -> tuple[array[int], array[float]]:
    """An answer's ids and log-probs as the sample store's arrays (int32, float32; log-probs 0.0
    when the answer has none), converted here, where the answer is parsed, so that the event loop
    only appends bytes. Raises :class:`ProtocolError` for an id that does not fit an int32."""
    try:
        out = array("i", ids)
    except OverflowError:
        i = _bad_item(cast(list[JSON], ids), lambda t: isinstance(t, int) and -(1 << 31) <= t < (1 << 31))
        raise ProtocolError(f"output_ids[{i}] does not fit a 32-bit token id: {ids[i]!r}") from None
    return out, array("f", logprobs) if logprobs is not None else array("f", bytes(4 * len(ids)))


def _join_and_parse(pieces: list[bytes]) -> GenerateResponse:
    return parse_generate(b"".join(pieces))


async def decode_generate(body: bytes | list[bytes], decoder: Executor | None = None) -> GenerateResponse:
    """:func:`parse_generate` of ``body`` (its bytes, or the pieces it arrived in), in a worker
    thread when it is big: joining the pieces too (a copy of the whole answer). ``decoder``: the
    executor to decode in (None: the loop's default one).

    WHY a decoder of its own: the decode holds the GIL (orjson, array conversion, base64), so
    several threads decoding at once add no throughput, but each is one more thread the event loop
    waits behind to retake the GIL after every socket call: a loop ticking beside 4 decoding
    threads lagged several times more than beside 1, when it was measured."""
    pieces = [body] if isinstance(body, (bytes, bytearray)) else body
    if sum(len(p) for p in pieces) > BIG_ANSWER_BYTES:
        return await asyncio.get_running_loop().run_in_executor(decoder, _join_and_parse, pieces)  # None: the default
    return parse_generate(b"".join(pieces))

