"""Decoding a ``/generate`` answer, off the event loop when it is big.

WHY: at reasoning lengths one answer is thousands of tokens (a 30K-token answer is ~1 MB of JSON,
and with routed experts of a 48-layer top-8 MoE another ~60 MB of base64), and a controller
receives thousands of them per step. Parsed on the event loop, a burst of them held it for seconds
(``docs/results/controller_scale.md``), delaying every dispatch, stats poll and weight switch.
Here an answer above :data:`BIG_ANSWER_BYTES` is decoded in a worker thread: the routed experts'
base64 is cut out of the raw bytes first and decoded in slices (the JSON parser never scans it,
and no single call holds the GIL for long) into the smallest integer array that holds the expert
ids; the rest is parsed with orjson when installed (several times faster than ``json``). A
malformed answer raises :class:`~dora_megatron.comm.protocol.ProtocolError` naming the field.
"""

from __future__ import annotations

import asyncio
import binascii
import json
from typing import Any

import numpy as np

from dora_megatron.comm.batch_files import expert_dtype
from dora_megatron.comm.protocol import GenerateResponse, ProtocolError

try:
    import orjson

    _loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    _loads = json.loads
    _JSONError = (json.JSONDecodeError,)

#: answers above this many bytes are decoded in a worker thread (below, the thread hop costs more)
BIG_ANSWER_BYTES = 8 * 1024
#: base64 characters decoded per call (a multiple of 4): the GIL is free between two slices
B64_SLICE = 4 << 20
_ROUTED_KEY = b'"routed_experts"'


def split_routed(body: bytes) -> tuple[bytes, bytes | None]:
    """``body`` with ``meta_info.routed_experts``' text replaced by ``null``, and that text (None:
    the answer carries none as a string)."""
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
    return body[:j] + b"null" + body[end + 1:], body[j + 1:end]


def decode_routed(text: bytes) -> np.ndarray:
    """SGLang's base64 of little-endian int32 expert ids -> a flat array of the smallest signed
    integer type that holds them (int8 up to 127 experts: 1 byte an id, not 4)."""
    if len(text) % 4:
        raise ProtocolError(f"meta_info.routed_experts: {len(text)} base64 characters, not a multiple of 4")
    try:
        raw = b"".join(binascii.a2b_base64(text[i:i + B64_SLICE], strict_mode=True)
                       for i in range(0, len(text), B64_SLICE))
    except binascii.Error as err:
        raise ProtocolError(f"meta_info.routed_experts is not base64: {err}") from None
    if len(raw) % 4:
        raise ProtocolError(f"meta_info.routed_experts: {len(raw)} bytes, not a whole number of int32 ids")
    ids = np.frombuffer(raw, dtype="<i4")
    return ids.astype(expert_dtype(int(ids.max()) + 1 if ids.size else 1))


def _bad_item(values: list, ok) -> int:
    return next(i for i, v in enumerate(values) if not ok(v))


def parse_generate(body: bytes) -> GenerateResponse:
    """A ``/generate`` answer's bytes -> :class:`GenerateResponse` (``raw["meta_info"]["routed_experts"]``
    decoded to an integer array). Raises :class:`ProtocolError` naming the malformed field."""
    if not body:
        return GenerateResponse.from_json({})
    body, routed = split_routed(body)
    try:
        d = _loads(body)
    except _JSONError as err:
        raise ProtocolError(f"/generate answer is not JSON: {err}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"/generate answer must be a JSON object, got {type(d).__name__}")
    ids = d.get("output_ids") or []
    if not isinstance(ids, list):
        raise ProtocolError(f"output_ids must be a list of token ids, got {type(ids).__name__}")
    if not all(type(t) is int for t in ids):
        i = _bad_item(ids, lambda t: type(t) is int)
        raise ProtocolError(f"output_ids[{i}] must be a token id, got {ids[i]!r}")
    meta = d.get("meta_info") or {}
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta_info must be an object, got {type(meta).__name__}")
    lps, logprobs = meta.get("output_token_logprobs"), None
    if lps is not None:
        if not isinstance(lps, list):
            raise ProtocolError("meta_info.output_token_logprobs must be a list of [logprob, token_id, text]")
        try:
            logprobs = [float(x[0]) for x in lps]
        except (TypeError, ValueError, IndexError, KeyError):
            i = _bad_item(lps, lambda x: isinstance(x, list) and x and isinstance(x[0], (int, float)))
            raise ProtocolError(f"meta_info.output_token_logprobs[{i}] must be [logprob, token_id, text], "
                                f"got {str(lps[i])[:80]}") from None
        if len(lps) != len(ids):
            raise ProtocolError(f"meta_info.output_token_logprobs has {len(lps)} entries for {len(ids)} output_ids")
    if routed is not None:
        meta["routed_experts"] = decode_routed(routed)
    resp = GenerateResponse.from_json(d)
    resp.output_token_logprobs = logprobs
    return resp


async def decode_generate(body: bytes) -> GenerateResponse:
    """:func:`parse_generate`, in a worker thread when ``body`` is big."""
    if len(body) > BIG_ANSWER_BYTES:
        return await asyncio.to_thread(parse_generate, body)
    return parse_generate(body)

