"""The SGLang client against replies shaped as SGLang 0.5.23 sends them, and every request body it
sends checked with SGLang 0.5.23's own request types (from the wheel, see ``tests/sglang_wheel.py``).

The fake server answers each route the way ``sglang/srt/entrypoints/http_server.py`` does (plain
text for ``/flush_cache``, an empty 200 for ``/abort_request``, ``/v1/loads`` as
``entrypoints/v1_loads.py`` builds it) and records what it was asked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import EngineError, VersionMismatch
from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.comm.sglang_client import SGLangClient, summarize_loads
from dora_megatron.rollout.sglang.engine import SGLangEngine
from tests import sglang_wheel

#: /v1/loads of an idle-queue 0.5.23 server holding 120 tokens of KV in a 40000-token pool
#: (load_inquirer.py: num_total_tokens = used + tokens of waiting requests)
LOADS = {"version": "0.5.23", "loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0,
                                         "num_used_tokens": 120, "num_total_tokens": 120,
                                         "max_total_num_tokens": 40000, "token_usage": 0.003}]}


def _app(calls: list[tuple[str, str, Any]], flush_ok: bool = True) -> web.Application:
    async def record(request: web.Request) -> Any:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        calls.append((request.method, request.path, body))
        return body

    async def ok(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"success": True, "message": "Success"})

    async def flush(request: web.Request) -> web.Response:
        await record(request)
        if flush_ok:
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details.\n")
        return web.Response(text="Flush cache failed.\n", status=400)

    async def abort(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=200)

    async def loads(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response(LOADS)

    async def model_info(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"model_path": "/m", "weight_version": "7", "load_format": "dummy"})

    async def generate(request: web.Request) -> web.Response:
        body = await record(request)
        return web.json_response({"output_ids": [5, 6], "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
            "completion_tokens": 2, "weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 2}],
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}})

    async def checker(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"success": True, "message": "Success.", "per_engine_checksum": "ab" * 32})

    async def pause(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    app = web.Application()
    for path in ("/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
                 "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group"):
        app.router.add_post(path, ok)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", pause)
    app.router.add_route("*", "/flush_cache", flush)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/generate", generate)
    app.router.add_route("*", "/weights_checker", checker)
    return app


def _with_server(fn, flush_ok: bool = True) -> list[tuple[str, str, Any]]:
    calls: list[tuple[str, str, Any]] = []

    async def go():
        async with TestServer(_app(calls, flush_ok)) as server:
            client = SGLangClient(str(server.make_url("")).rstrip("/"), timeout_s=30)
            try:
                await fn(client)
            finally:
                await client.close()

    asyncio.run(go())
    return calls


def test_kv_usage_is_the_used_share_of_the_pool_not_used_over_num_total_tokens():
    got = summarize_loads(LOADS)
    assert got["kv_usage"] == pytest.approx(120 / 40000)
    assert got["num_running_reqs"] == 1 and got["num_waiting_reqs"] == 0
    # a server that reports no pool size: its token_usage
    no_pool = {"loads": [{**LOADS["loads"][0], "max_total_num_tokens": 0, "token_usage": 0.25}]}
    assert summarize_loads(no_pool)["kv_usage"] == pytest.approx(0.25)


def test_flush_cache_reads_the_plain_text_reply():
    results: list[bool] = []

    async def flush(c: SGLangClient) -> None:
        results.append(await c.flush_cache())

    _with_server(flush)
    _with_server(flush, flush_ok=False)
    assert results == [True, False]


def test_load_and_version_polls_never_reach_the_scheduler_bound_routes():
    async def poll(c: SGLangClient) -> None:
        info = await c.server_info()
        assert info["kv_usage"] == pytest.approx(0.003) and info["num_running_reqs"] == 1
        assert await c.weight_version() == "7"
        assert not await c.supports("export_request")

    paths = {p for _, p, _ in _with_server(poll)}
    assert paths <= {"/v1/loads", "/model_info"}, paths


def test_disk_update_names_its_load_format():
    async def update(c: SGLangClient) -> None:
        await c.update_weights_from_disk("/snap/v3", weight_version=3)

    (_, _, body), = _with_server(update)
    assert body["load_format"] == "auto" and body["weight_version"] == "3" and body["model_path"] == "/snap/v3"


def test_instance_checksum_comes_from_weights_checker():
    async def check(c: SGLangClient) -> None:
        assert await c.instance_checksum() == "ab" * 32

    (_, path, body), = _with_server(check)
    assert path == "/weights_checker" and body == {"action": "checksum"}


async def _every_call(c: SGLangClient) -> None:
    """Every request the production path sends to an SGLang server."""
    await c.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                 "stop_token_ids": [2], "sampling_seed": 11}, rid="s1#", return_logprob=True)
    await c.abort("s1#")
    await c.abort(abort_all=True)
    await c.pause("retract")
    await c.init_weights_update_group("127.0.0.1", 29500, 1, 2, "g", "nccl")
    await c.begin_weight_update()
    await c.update_weights_from_distributed(["a.weight"], ["torch.bfloat16"], [[4, 2]], group_name="g",
                                            weight_version=None, flush_cache=False)
    await c.update_weights_from_distributed(["b.weight"], ["float32"], [[3]], group_name="g", weight_version=5,
                                            flush_cache=True)
    await c.end_weight_update()
    await c.continue_generation()
    await c.destroy_weights_update_group("g")
    await c.update_weights_from_disk("/snap/v5", weight_version=5)
    await c.instance_checksum()
    await c.flush_cache()


def test_every_request_body_is_accepted_by_sglang_0_5_23_request_types():
    schemas = sglang_wheel.load()
    if schemas is None:
        pytest.skip("SGLang 0.5.23's wheel or msgspec is missing: run tools/setup_env.sh")
    assert schemas.version == sglang_wheel.WHEEL_VERSION
    calls = _with_server(_every_call)
    checked = 0
    for method, path, body in calls:
        if path not in sglang_wheel.ROUTES:
            assert path == "/flush_cache" and not body  # takes no body
            continue
        schemas.validate(path, body if body is not None else {})
        assert schemas.ignored_fields(path, body or {}) == [], f"{path}: SGLang would silently drop these"
        checked += 1
    assert checked == len(calls) - 1


def test_the_wheel_schemas_refuse_what_sglang_refuses():
    """The validator is not a rubber stamp: bodies SGLang 0.5.23 rejects are rejected."""
    schemas = sglang_wheel.load()
    if schemas is None:
        pytest.skip("SGLang 0.5.23's wheel or msgspec is missing: run tools/setup_env.sh")
    with pytest.raises(sglang_wheel.SchemaError, match="dora_version"):
        schemas.validate("/generate", {"input_ids": [1], "sampling_params": {"dora_version": "1"}})
    with pytest.raises(sglang_wheel.SchemaError):
        schemas.validate("/pause_generation", {"mode": "drain"})
    with pytest.raises(sglang_wheel.SchemaError):
        schemas.validate("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]})
    assert schemas.ignored_fields("/update_weights_from_disk", {"model_path": "/m", "weight_verison": "1"}) == [
        "weight_verison"]


class _FakeClient(SGLangClient):
    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__("http://sglang.invalid")
        self.meta = meta

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       routed_experts=False):
        return GenerateResponse.from_json({"output_ids": [1, 2, 3], "meta_info": {"id": rid, **self.meta}})


def _spans(*triples):
    return [{"version": v, "start": s, "end": e} for v, s, e in triples]


def test_an_answer_that_crossed_an_update_keeps_its_spans_and_one_that_started_elsewhere_is_refused():
    crossed = {"finish_reason": {"type": "stop"}, "weight_version": "2", "weight_versions": _spans(("1", 0, 2), ("2", 2, 3))}
    stale = {"finish_reason": {"type": "stop"}, "weight_version": "1", "weight_versions": _spans(("0", 0, 1), ("1", 1, 3))}

    async def go():
        resp = await SGLangEngine(_FakeClient(crossed)).generate([1], rid="s1", version=1)
        assert resp.versions_used == ["1", "2"] and resp.rid == "s1"
        with pytest.raises(VersionMismatch):
            await SGLangEngine(_FakeClient(stale)).generate([1], rid="s2", version=1)
        # an SGLang older than 0.5.22 (no spans): the echoed version decides, as before
        with pytest.raises(VersionMismatch):
            await SGLangEngine(_FakeClient({"weight_version": "2"})).generate([1], rid="s3", version=1)

    asyncio.run(go())


def test_a_refused_session_call_raises_with_sglangs_message():
    async def app_fn(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "a weight-update session is already open; "
                                  "call end_weight_update() first"}, status=400)

    async def go():
        app = web.Application()
        app.router.add_post("/begin_weight_update", app_fn)
        async with TestServer(app) as server:
            c = SGLangClient(str(server.make_url("")).rstrip("/"))
            with pytest.raises(EngineError, match="already open"):
                await c.begin_weight_update()
            await c.close()

    asyncio.run(go())


def test_an_untested_sglang_release_gets_a_warning_naming_the_tested_one():
    from dora_megatron.rollout.sglang.server import check_versions

    def app_for(version):
        async def loads(request: web.Request) -> web.Response:
            return web.json_response({**LOADS, "version": version})

        app = web.Application()
        app.router.add_get("/v1/loads", loads)
        return app

    async def go():
        out = []
        for version in ("0.5.23", "0.5.21"):
            async with TestServer(app_for(version)) as server:
                out.append(await check_versions([str(server.make_url("")).rstrip("/")]))
        return out

    tested, older = asyncio.run(go())
    assert tested == []
    (warning,) = older
    assert "SGLang 0.5.21" in warning and "tested with SGLang 0.5.23" in warning


def test_weight_updates_load_only_the_target_runner():
    """A draft runner (EAGLE, NEXTN) must not be handed the policy's tensors: SGLang's default
    selector ``all`` would give them to it (docs/sglang.md, "Speculative decoding")."""
    async def push(c: SGLangClient) -> None:
        await c.begin_weight_update()
        await c.update_weights_from_distributed(["a.weight"], ["float32"], [[2]], group_name="g", weight_version=1)
        await c.end_weight_update()

    bodies = {path: body for _, path, body in _with_server(push)}
    assert bodies["/begin_weight_update"] == {"selector": "target"}
    assert bodies["/update_weights_from_distributed"]["selector"] == "target"
