"""The stand-in answers as the real SGLang 0.5.23 server does: one sequence of requests, sent to
both, compared status by status and shape by shape.

Opt-in tier (marker ``sglang``, ``DORA_SGLANG=1``, the venv of ``tools/setup_sglang_cpu.sh``);
skipped without it, a failure under ``CI=true`` (``tests/helpers/sglang_real.py``).

WHY: ``tests/sglang_standin.py`` was written from reading SGLang's source; the SGLang-path tests
that use it (TP/EP over NCCL and EPLB need a GPU, so those stay on it) are only as good as that
reading. Here the same requests, the ones dora sends (``GenerateRequest.to_json`` bodies with
``return_logprob``, every pause mode, disk updates with ``weight_version``, aborts by rid and all,
``/v1/loads`` with and without ``?include=core``, model info, ``/flush_cache``) and the errors a
client can cause (a body of the wrong type, one that is not JSON, a missing field, an unknown
route, ``/get_weight_version`` which 0.5.23 does not have), go to the stand-in and to the real
server on the same tiny Qwen3-MoE. Status codes must be equal, and response bodies equal in shape:
the same keys, recursively, with values of the same JSON type (values themselves differ where they
legitimately do: timings, ids, log-probabilities of two implementations). Where meaning matters
the values are compared too (weight versions, finish reasons, token counts, empty abort bodies).

Every shape difference that remains is listed in :data:`CPU_SGLANG_CANNOT`, with the reason;
the test fails on an unlisted difference and on a listed one that no longer occurs.

The module's two real servers then run the stand-in's push choreography of
``tests/integration/test_sglang_path.py`` (both needed there): one start of two servers serves
both claims (a real server takes 30-140 s to start on two cores).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

from dora_megatron.comm.protocol import PAUSE_MODES, GenerateRequest, SamplingParams
from dora_megatron.rollout.sglang.engine import FLUSH_RETRY_S
from tests.helpers.push_choreography import check_push_choreography, model_dir  # noqa: F401 - a fixture
from tests.sglang_standin import start_standin

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

PROMPT = [4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 3000, "ignore_eos": True}

#: shape differences that remain, each with why: path -> reason. Empty when the stand-in agrees.
CPU_SGLANG_CANNOT: dict[str, str] = {}


# ---------------------------------------------------------------- shapes
def shape(value: Any) -> Any:
    """The JSON type of ``value``, recursively: dicts keep their keys, lists the distinct shapes
    of their items (so lengths do not matter), numbers are one type (JSON has one)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        items: list[Any] = []
        for v in value:
            s = shape(v)
            if s not in items:
                items.append(s)
        return ["list", items]
    return type(value).__name__


def shape_diff(ours: Any, real: Any, path: str) -> dict[str, str]:
    """Where the two shapes differ: path -> what each side has. An empty list matches any list
    (no item to compare)."""
    if isinstance(ours, dict) and isinstance(real, dict):
        out: dict[str, str] = {}
        for k in sorted(set(ours) | set(real)):
            p = f"{path}.{k}"
            if k not in real:
                out[p] = "only the stand-in has it"
            elif k not in ours:
                out[p] = "only SGLang has it"
            else:
                out.update(shape_diff(ours[k], real[k], p))
        return out
    if isinstance(ours, list) and isinstance(real, list) and ours[0] == real[0] == "list":
        if not ours[1] or not real[1]:
            return {}
        if len(ours[1]) == len(real[1]) == 1:
            return shape_diff(ours[1][0], real[1][0], path + "[]")
        return {} if ours == real else {path + "[]": f"stand-in {ours[1]} vs SGLang {real[1]}"}
    return {} if ours == real else {path: f"stand-in {ours} vs SGLang {real}"}


# ---------------------------------------------------------------- the sequence
async def call(http: aiohttp.ClientSession, url: str, method: str, path: str, body: Any = None,
               raw: bytes | None = None) -> tuple[int, Any]:
    """One request; the answer's status and body (JSON when it parses, else text)."""
    kwargs: dict[str, Any] = {"json": body} if raw is None else {
        "data": raw, "headers": {"Content-Type": "application/json"}}
    async with http.request(method, url + path, **({} if body is None and raw is None else kwargs)) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text) if text else ""
    except ValueError:
        return resp.status, text


def gen_body(rid: str, params: dict[str, Any], prompt: list[int] = PROMPT) -> dict[str, Any]:
    """The body dora's client sends (``EngineClient.generate``)."""
    return GenerateRequest(prompt, SamplingParams.from_json(params), rid, True).to_json()


async def running(http: aiohttp.ClientSession, url: str, timeout_s: float = 120.0) -> None:
    """Until one request runs (``/v1/loads?include=core``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, body = await call(http, url, "GET", "/v1/loads?include=core")
        if sum(int(load.get("num_running_reqs", 0)) for load in body["loads"]):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}: the long request never ran")


async def flush_when_idle(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """``/flush_cache`` as dora sends it (``SGLangEngine`` retries a refused flush for up to
    ``FLUSH_RETRY_S``): real 0.5.23 can still count the request just answered as running and
    answer 400 ``Flush cache failed``, so a refusal is retried; the last answer is what counts."""
    deadline = time.monotonic() + FLUSH_RETRY_S
    while True:
        answer = await call(http, url, "POST", "/flush_cache")
        if answer[0] == 200 or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.1)


async def sequence(url: str, model_dir: str) -> dict[str, tuple[int, Any]]:
    """The requests, in order; step name -> (status, body)."""
    out: dict[str, tuple[int, Any]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def step(name: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> None:
            out[name] = await call(http, url, method, path, body, raw)

        await step("model_info", "GET", "/get_model_info")
        await step("loads", "GET", "/v1/loads")
        await step("loads_core", "GET", "/v1/loads?include=core")
        await step("generate", "POST", "/generate", gen_body("conf-1", GREEDY))
        for mode in PAUSE_MODES:
            await step(f"pause_{mode}", "POST", "/pause_generation", {"mode": mode})
            await step(f"update_paused_{mode}", "POST", "/update_weights_from_disk",
                       {"model_path": model_dir, "load_format": "auto", "weight_version": f"v-{mode}",
                        "flush_cache": True, "abort_all_requests": False})
            await step(f"continue_{mode}", "POST", "/continue_generation", {})
        await step("model_info_updated", "GET", "/model_info")
        await step("generate_updated", "POST", "/generate", gen_body("conf-2", GREEDY))
        out["flush_cache"] = await flush_when_idle(http, url)
        await step("abort_unknown_rid", "POST", "/abort_request", {"rid": "nobody"})
        await step("abort_all_idle", "POST", "/abort_request", {"abort_all": True})
        # prompts of their own: a prompt SGLang's radix cache holds would answer cached_tokens_details,
        # which the stand-in's engine (no prefix cache) never reports
        for n, (name, abort) in enumerate((("abort_by_rid", {"rid": "conf-long-0"}), ("abort_all", {"abort_all": True}))):
            long = asyncio.ensure_future(call(http, url, "POST", "/generate",
                                              gen_body(f"conf-long-{n}", LONG, [30 + n, *PROMPT])))
            await running(http, url)
            await step(name, "POST", "/abort_request", abort)
            out[f"generate_{name}"] = await asyncio.wait_for(long, 120)
        await step("generate_wrong_type", "POST", "/generate", {"input_ids": "not a list"})
        await step("generate_not_json", "POST", "/generate", raw=b"{not json")
        await step("update_no_model_path", "POST", "/update_weights_from_disk", {"weight_version": "x"})
        await step("update_no_such_dir", "POST", "/update_weights_from_disk",
                   {"model_path": "/nonexistent/dora-model", "load_format": "auto", "weight_version": "x"})
        await step("model_info_after_failed_update", "GET", "/model_info")
        await step("unknown_route", "GET", "/no_such_route")
        await step("get_weight_version", "GET", "/get_weight_version")
    return out


# ---------------------------------------------------------------- the servers
@pytest.fixture(scope="module")
def real_servers(model_dir, tmp_path_factory):
    """Two real SGLang servers, started in parallel, for this module's tests (the sequence uses the
    first, the push choreography both); stopped by pid."""
    from tests.helpers.sglang_real import require_sglang, start_real_sglang

    require_sglang()
    logs = tmp_path_factory.mktemp("sglang-logs")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_real_sglang, model_dir, logs, name=f"sgl{i}", weight_version="0")
                   for i in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise RuntimeError(f"SGLang start failed: {[f.exception() for f in futures if f.exception()]}")
        print("start to ready, s:", [round(e.ready_s, 1) for e in started])
        yield started
    finally:
        for e in started:
            e.stop()


@pytest.fixture(scope="module")
def answers(real_servers, model_dir, tmp_path_factory):
    """Both servers' answers to the sequence: the stand-in's, stopped by pid before the real
    server's run (two busy servers at once would share the machine's two cores; the second real
    server sleeps while idle)."""
    got: dict[str, dict[str, tuple[int, Any]]] = {}
    standin = start_standin(model_dir, tmp_path_factory.mktemp("conformance"), name="standin")
    try:
        got["standin"] = asyncio.run(sequence(standin.url, model_dir))
    finally:
        standin.stop()
    got["sglang"] = asyncio.run(sequence(real_servers[0].url, model_dir))
    return got


def test_status_codes_agree(answers):
    ours, real = answers["standin"], answers["sglang"]
    assert list(ours) == list(real)
    codes = {name: (ours[name][0], real[name][0]) for name in real}
    assert {n: c for n, c in codes.items() if c[0] != c[1]} == {}
    # the sequence itself did what it says, on both
    assert codes["generate"] == codes["abort_by_rid"] == (200, 200)
    assert codes["unknown_route"] == codes["get_weight_version"] == (404, 404)
    assert codes["update_no_such_dir"] == (400, 400)


def test_response_shapes_agree_field_by_field(answers):
    ours, real = answers["standin"], answers["sglang"]
    diffs: dict[str, str] = {}
    for name in real:
        diffs.update(shape_diff(shape(ours[name][1]), shape(real[name][1]), name))
    unnamed = {p: d for p, d in diffs.items() if p not in CPU_SGLANG_CANNOT}
    assert unnamed == {}, json.dumps(unnamed, indent=1)
    assert set(CPU_SGLANG_CANNOT) <= set(diffs), "a named difference no longer occurs: drop it"


def test_values_that_carry_meaning_agree(answers):
    ours, real = answers["standin"], answers["sglang"]
    for side in (ours, real):
        # a disk update with weight_version sets it, through a pause of each mode
        assert side["model_info"][1]["weight_version"] == "0"
        assert side["model_info_updated"][1]["weight_version"] == f"v-{PAUSE_MODES[-1]}"
        assert side["generate_updated"][1]["meta_info"]["weight_version"] == f"v-{PAUSE_MODES[-1]}"
        assert side["model_info_after_failed_update"][1]["weight_version"] == f"v-{PAUSE_MODES[-1]}"
        for mode in PAUSE_MODES:
            assert side[f"update_paused_{mode}"][1]["success"] is True
        assert side["update_no_such_dir"][1]["success"] is False
        # abort answers 200 with an empty body, matched or not
        for name in ("abort_unknown_rid", "abort_all_idle", "abort_by_rid", "abort_all"):
            assert side[name] == (200, ""), name
        assert side["flush_cache"][1].startswith("Cache flushed.")
    for name in ("generate", "generate_updated"):
        a, b = ours[name][1], real[name][1]
        assert len(a["output_ids"]) == len(b["output_ids"]) == GREEDY["max_new_tokens"]
        for key in ("finish_reason", "prompt_tokens", "completion_tokens", "id"):
            assert a["meta_info"][key] == b["meta_info"][key], (name, key)
        assert [lp[1] for lp in a["meta_info"]["output_token_logprobs"]] == a["output_ids"]
        assert [lp[1] for lp in b["meta_info"]["output_token_logprobs"]] == b["output_ids"]
    for name in ("generate_abort_by_rid", "generate_abort_all"):
        for side in (ours, real):
            reason = side[name][1]["meta_info"]["finish_reason"]
            assert reason["type"] == "abort", (name, reason)
            assert 0 < side[name][1]["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]


# ---------------------------------------------------------------- the stand-in's push scenario, real
# After the sequence (it reloads its weights from disk first), on this module's two real servers.
# The stand-in's migration scenario (a resubmitted greedy continuation equals the uninterrupted
# sequence token for token) is not run here: on real 0.5.23 in float32 the re-prefill's logits differ
# from decoding's in the last bits, and at a near-tie the continuation leaves the sequence (seen in
# the clean-clone CI re-run of 2026-12-06: EOS after 16 tokens uninterrupted, another token after the
# move). The tier's train jobs move requests by resubmit on real servers and check nothing is lost.
# The push scenario runs its whole choreography (abort, then retract pause over gloo) and fails at one
# assertion, where 0.5.23 differs from the stand-in: a push naming a tensor the model lacks
# ("experts.99") is accepted, where the stand-in refuses before receiving ("DID NOT RAISE PushError");
# strict: once it passes, drop the mark.
@pytest.mark.xfail(raises=pytest.fail.Exception, strict=True, reason="real SGLang 0.5.23 accepts a distributed "
                   "update naming a tensor the model lacks (the stand-in refuses it)")
def test_distributed_push_abort_and_retract_on_real_sglang(real_servers, answers, model_dir):
    check_push_choreography(real_servers, model_dir)
