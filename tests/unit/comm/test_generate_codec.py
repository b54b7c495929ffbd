"""Decoding /generate answers (dora_megatron.comm.generate_codec): what the JSON path gave, routed
experts as compact arrays, big answers through the worker thread, malformed fields named."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from dora_megatron.comm.generate_codec import BIG_ANSWER_BYTES, decode_generate, parse_generate, split_routed
from dora_megatron.comm.protocol import GenerateResponse, ProtocolError


def _answer(n: int, experts: int | None = None, layers: int = 2, top_k: int = 2, text: str = "") -> dict:
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 150_000, n).tolist()
    meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": n,
            "weight_version": "4", "weight_versions": [{"version": "4", "start": 0, "end": n}],
            "output_token_logprobs": [[-float(x), t, None] for x, t in zip(rng.random(n), ids)]}
    if experts is not None:
        routed = rng.integers(-1, experts, (3 + n - 1) * layers * top_k).astype("<i4")
        meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode()
    return {"text": text, "output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize("n, experts, dtype", [(5, 128, np.int8), (800, 128, np.int8), (40, 300, np.int16)])
def test_decoded_answer_matches_the_json_path_with_compact_routing(n, experts, dtype):
    d = _answer(n, experts)
    body = json.dumps(d).encode()
    got = asyncio.run(decode_generate(body))
    want = GenerateResponse.from_json(json.loads(body))
    for f in ("rid", "output_ids", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
              "output_token_logprobs", "weight_versions"):
        assert getattr(got, f) == getattr(want, f), f
    routed = got.raw["meta_info"]["routed_experts"]
    assert routed.dtype == dtype
    assert routed.tolist() == np.frombuffer(base64.b64decode(d["meta_info"]["routed_experts"]), "<i4").tolist()
    assert (len(body) > BIG_ANSWER_BYTES) == (n == 800)  # the worker-thread path is among the cases


def test_routed_experts_named_inside_the_generated_text_is_not_cut():
    d = _answer(4, 8, text='he wrote "routed_experts": "AAAA"')
    body, text = split_routed(json.dumps(d).encode())
    assert text == d["meta_info"]["routed_experts"].encode()
    assert json.loads(body)["text"] == d["text"] and json.loads(body)["meta_info"]["routed_experts"] is None


def test_routed_experts_in_slices_give_the_same_ids(monkeypatch):
    import dora_megatron.comm.generate_codec as codec

    d = _answer(300, 64)
    whole = parse_generate(json.dumps(d).encode()).raw["meta_info"]["routed_experts"]
    monkeypatch.setattr(codec, "B64_SLICE", 8)  # many slices: boundaries must not shift the ids
    assert parse_generate(json.dumps(d).encode()).raw["meta_info"]["routed_experts"].tolist() == whole.tolist()


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["output_ids"].__setitem__(2, "x"), r"output_ids\[2\]"),
    (lambda d: d["meta_info"]["output_token_logprobs"].__setitem__(1, []), r"meta_info\.output_token_logprobs\[1\]"),
    (lambda d: d["meta_info"]["output_token_logprobs"].pop(), r"output_token_logprobs has 3 entries for 4"),
    (lambda d: d["meta_info"].__setitem__("routed_experts", "AB!D"), r"meta_info\.routed_experts is not base64"),
    (lambda d: d["meta_info"].__setitem__("routed_experts", "AAA="), r"meta_info\.routed_experts: 2 bytes, not a whole"),
    (lambda d: d.__setitem__("meta_info", [1]), r"meta_info must be an object"),
])
def test_a_malformed_answer_names_the_field(mutate, field):
    d = _answer(4, 8)
    mutate(d)
    with pytest.raises(ProtocolError, match=field):
        parse_generate(json.dumps(d).encode())


def test_not_json_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_generate(b"<html>502</html>")
