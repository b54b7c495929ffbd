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


def test_sliced_decode_widens_when_a_later_slice_holds_a_larger_id(monkeypatch):
    """The first slices fit int8; an id of 40,000 in the last one needs int32: the earlier ids
    survive the widening, and the whole array is what SGLang's int32 bytes hold."""
    import dora_megatron.comm.generate_codec as codec

    ids = np.concatenate([np.arange(-1, 90, dtype="<i4"), np.array([300, 5, 40_000, 7], dtype="<i4")])
    text = base64.b64encode(ids.tobytes())
    monkeypatch.setattr(codec, "B64_SLICE", 16)  # 4 ids a slice: int8, then int16 (300), then int32
    got = codec.decode_routed(text)
    assert got.dtype == np.int32
    assert got.tolist() == ids.tolist()
    small = codec.decode_routed(base64.b64encode(ids[:92].tobytes()))  # up to 89 and 300: int16
    assert small.dtype == np.int16 and small.tolist() == ids[:92].tolist()


def test_routed_experts_are_a_view_into_the_answer_not_a_copy():
    d = _answer(40, 64)
    body = json.dumps(d).encode()
    _, text = split_routed(body)
    assert isinstance(text, memoryview) and text.obj is body
    assert bytes(text) == d["meta_info"]["routed_experts"].encode()


@pytest.mark.parametrize("routed, field", [
    ("AAAAAAA", r"7 base64 characters, not a multiple of 4"),  # short: cut mid-character
    ("AAAA", r"3 bytes, not a whole number of int32 ids"),  # short: cut mid-id
    ("AAAAAA==AAAAAAAA", r"is not base64 \(at character 0 or after\)"),  # padding inside
    ("AAAAAAAA" * 3 + "AAAAAA!A", r"is not base64 \(at character 0 or after\)"),
    ("AAAAAAAA" * 3 + "AA!A", r"is not base64"),  # not base64 and short: named not base64
])
def test_bad_or_short_routed_experts_are_refused_naming_the_sample(routed, field):
    d = _answer(4, 8)
    d["meta_info"]["id"] = "sample-17"
    d["meta_info"]["routed_experts"] = routed
    with pytest.raises(ProtocolError, match=r"the answer to 'sample-17': meta_info\.routed_experts.*" + field):
        parse_generate(json.dumps(d).encode())


def test_padding_at_a_slice_end_inside_the_text_is_refused(monkeypatch):
    """16 characters a slice: one ending in "=" decodes alone (11 bytes), yet it is not the text's end."""
    import dora_megatron.comm.generate_codec as codec

    monkeypatch.setattr(codec, "B64_SLICE", 16)
    with pytest.raises(ProtocolError, match=r"'=' padding before the text's end \(at character 16 or after\)"):
        codec.decode_routed(b"A" * 16 + b"A" * 15 + b"=" + b"A" * 16)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["output_ids"].__setitem__(2, "x"), r"output_ids\[2\]"),
    (lambda d: d["meta_info"]["output_token_logprobs"].__setitem__(1, []), r"meta_info\.output_token_logprobs\[1\]"),
    (lambda d: d["meta_info"]["output_token_logprobs"].pop(), r"output_token_logprobs has 3 entries for 4"),
    (lambda d: d["meta_info"].__setitem__("routed_experts", "AB!D"), r"meta_info\.routed_experts is not base64"),
    (lambda d: d["meta_info"].__setitem__("routed_experts", "AAA="), r"meta_info\.routed_experts: 2 bytes, not a whole"),
    (lambda d: d.__setitem__("meta_info", [1]), r"meta_info must be a JSON object, got \[1\]"),
    (lambda d: d["output_ids"].__setitem__(1, True), r"output_ids\[1\] must be an integer, got True"),
    (lambda d: d["output_ids"].__setitem__(3, [5]), r"output_ids\[3\] must be an integer, got \[5\]"),
    (lambda d: d.__setitem__("output_ids", {"a": 1}), r"output_ids must be a list, got \{'a': 1\}"),
    (lambda d: d["meta_info"]["weight_versions"][0].__setitem__("end", 4.0),
     r"meta_info\.weight_versions\[0\]\.end must be an integer, got 4\.0"),
])
def test_a_malformed_answer_names_the_field(mutate, field):
    d = _answer(4, 8)
    mutate(d)
    with pytest.raises(ProtocolError, match=field):
        parse_generate(json.dumps(d).encode())


def test_an_answer_that_is_no_object_is_named():
    with pytest.raises(ProtocolError, match=r"^/generate answer must be a JSON object, got \[1, 2\]$"):
        parse_generate(b"[1, 2]")


def test_not_json_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_generate(b"<html>502</html>")


def test_a_big_answer_is_read_in_pieces_and_joined_and_decoded_off_the_loop(monkeypatch):
    """An EngineClient against a server streaming a ~3 MB answer (with routed experts) in small
    writes: the pieces reach the decoder unjoined, and the join and the decode run in a worker
    thread, not the loop's (at reasoning lengths both are proportional to tokens)."""
    import threading

    from aiohttp import web

    import dora_megatron.comm.generate_codec as codec
    from dora_megatron.comm.engine_client import EngineClient

    d = _answer(30_000, 128, layers=4, top_k=4)
    body = json.dumps(d).encode()
    seen: list[tuple[int, int]] = []
    real = codec._join_and_parse

    def recording(pieces):
        seen.append((threading.get_ident(), len(pieces)))
        return real(pieces)

    monkeypatch.setattr(codec, "_join_and_parse", recording)

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for i in range(0, len(body), 64 << 10):  # the socket hands the client pieces, as a real answer does
            await resp.write(body[i:i + (64 << 10)])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def get_info(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/get_server_info", get_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with EngineClient(f"http://127.0.0.1:{port}") as client:
                return threading.get_ident(), await client.generate([1, 2, 3], {"max_new_tokens": 30_000},
                                                                    routed_experts=True)
        finally:
            await runner.cleanup()

    loop_thread, got = asyncio.run(main())
    assert got.output_ids == d["output_ids"]
    assert got.raw["meta_info"]["routed_experts"].size == (3 + 30_000 - 1) * 16
    assert len(seen) == 1
    thread, pieces = seen[0]
    assert thread != loop_thread and pieces > 1


def test_log_probs_are_parsed_without_a_tracked_container_per_token():
    """A 30K-token answer's log-probs are not one Python list per token: those triggered garbage
    collections that scan every object the controller holds. The answer is the JSON path's, and
    the collector does not run while it is parsed."""
    import gc

    d = _answer(30_000)
    body = json.dumps(d).encode()
    want = GenerateResponse.from_json(json.loads(body))
    runs = []

    def note(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    try:
        got = parse_generate(body)
    finally:
        gc.callbacks.remove(note)
    assert got.output_token_logprobs == want.output_token_logprobs and got.output_ids == want.output_ids
    assert runs == []  # the nested parse runs the collector ~40 times here


@pytest.mark.parametrize("items", [
    [[-0.5, 3, "a],[b"], [-0.25, 4, None]],  # the tokens' text: brackets inside strings
    [[-0.5, 3], [-0.25, 4, None, 9]],  # items that are not [logprob, id, null]: their first numbers
    [[-0.5, 3, None, -0.75], [4, None]],
    [[0, 3, None], [-1e-05, 4, None]],  # an integer log-prob, an exponent
])
def test_log_probs_of_any_item_shape_are_the_first_numbers_as_the_json_path_has_them(items):
    d = {"output_ids": [3, 4], "meta_info": {"output_token_logprobs": items}}
    got = parse_generate(json.dumps(d).encode())
    assert got.output_token_logprobs == [float(x[0]) for x in items]
    assert all(type(x) is float for x in got.output_token_logprobs)


def _variants() -> list[tuple[str, dict]]:
    flat = _answer(800)
    nested = _answer(30)  # the tokens' text in the log-probs: the nested parse
    nested["meta_info"]["output_token_logprobs"] = [[lp, t, "x]"] for lp, t, _ in nested["meta_info"]["output_token_logprobs"]]
    bare = _answer(12)
    del bare["meta_info"]["output_token_logprobs"]
    return [("flat", flat), ("nested", nested), ("none", bare)]


@pytest.mark.parametrize("name, d", _variants())
def test_the_answers_arrays_are_bit_for_bit_what_the_store_appended_from_the_lists(name, d):
    from array import array

    from dora_megatron.controller.records import SampleRecord
    from dora_megatron.controller.samples import SampleStore

    resp = parse_generate(json.dumps(d).encode())
    ids, lps = resp.token_arrays
    assert (ids.typecode, lps.typecode) == ("i", "f") and len(ids) == len(lps) == len(d["output_ids"])
    # what SampleStore.apply did with the lists before (array.extend converting each token)
    want_ids, want_lps = array("i"), array("f")
    want_ids.extend(d["output_ids"])
    want_lps.extend([x[0] for x in d["meta_info"].get("output_token_logprobs", [])] or [0.0] * len(d["output_ids"]))
    assert ids.tobytes() == want_ids.tobytes() and lps.tobytes() == want_lps.tobytes()
    # the store appends the arrays, and gives what it gave appending the lists
    fast, slow = SampleRecord("s", "g", 0, 0, [1]), SampleRecord("s", "g", 0, 0, [1])
    for rec, r in ((fast, resp), (slow, GenerateResponse.from_json(json.loads(json.dumps(d))))):
        rec.response_ids.extend(array("i", [7]))  # an earlier submission's output, kept
        rec.rollout_logprobs.extend(array("f", [-1.0]))
        assert SampleStore.apply(rec, r) == "stop"
    assert slow.response_ids.tobytes() == fast.response_ids.tobytes() == array("i", [7]).tobytes() + want_ids.tobytes()
    assert slow.rollout_logprobs.tobytes() == fast.rollout_logprobs.tobytes() == array("f", [-1.0]).tobytes() + want_lps.tobytes()


def test_a_token_id_beyond_int32_is_named():
    d = _answer(6)
    d["output_ids"][3] = 1 << 31
    with pytest.raises(ProtocolError, match=r"output_ids\[3\] does not fit a 32-bit token id"):
        parse_generate(json.dumps(d).encode())


def test_a_clients_big_answers_are_decoded_on_its_readers_thread(monkeypatch):
    """Big answers of clients sharing an answer reader (the controller's one decoder thread) are
    decoded there, not on the loop's default executor; small ones stay on the loop."""
    import threading

    import dora_megatron.comm.generate_codec as codec
    from dora_megatron.comm.answer_reader import AnswerReader
    from dora_megatron.comm.engine_client import EngineClient

    big, small = json.dumps(_answer(2_000)).encode(), json.dumps(_answer(2)).encode()
    assert len(big) > BIG_ANSWER_BYTES > len(small)
    seen: list[str] = []
    real = codec.parse_generate

    def recording(body):
        seen.append(threading.current_thread().name)
        return real(body)

    monkeypatch.setattr(codec, "parse_generate", recording)
    reader = AnswerReader()

    async def main():
        clients = [EngineClient(f"http://127.0.0.1:{9}", reader=reader) for _ in range(3)]
        for c, body in zip(clients, (big, big, small)):
            async def answer(*_a, _body=body, **_k):
                return [_body[:100], _body[100:]], 0

            c._call_held = answer  # the answer as the socket delivered it, in pieces, nothing held
        got = await asyncio.gather(*(c.generate([1], {"max_new_tokens": 8}) for c in clients))
        for c in clients:
            await c.close()
        return threading.current_thread().name, got

    loop_thread, got = asyncio.run(main())
    reader.close()
    assert [len(r.output_ids) for r in got] == [2_000, 2_000, 2]
    assert sorted(seen) == sorted(["decode-answers_0", "decode-answers_0", loop_thread])
