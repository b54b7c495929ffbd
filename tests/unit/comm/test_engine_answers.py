"""The engine client reads the answers of the dora extensions as typed fields, and a malformed
answer (from a server this process did not write) raises a ProtocolError that names the route and
the field, not a KeyError or TypeError in the caller."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import EngineClient
from dora_megatron.comm.protocol import ProtocolError
from dora_megatron.comm.sglang_client import summarize_loads


def _serve(answers: dict[str, Any], call: Callable[[EngineClient], Awaitable[Any]]) -> Any:
    """``call`` on a client of a server answering each path of ``answers`` with that JSON."""

    def route(answer: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(answer)
        return handler

    async def go() -> Any:
        app = web.Application()
        for path, answer in answers.items():
            app.router.add_route("*", path, route(answer))
        async with TestServer(app) as server:
            async with EngineClient(str(server.make_url("")).rstrip("/"), timeout_s=30) as client:
                return await call(client)

    return asyncio.run(go())


INFO = {"/get_server_info": {"dora_extensions": ["keep_kv", "draft_sources", "weights_checksum"]}}


def test_well_formed_answers_give_their_fields():
    async def calls(c: EngineClient) -> tuple[int, bool, bool, str]:
        return (await c.import_kv(b"blob"), await c.release_kv("r1"), await c.add_draft_sources("r1", [[1, 2]]),
                await c.weights_checksum())

    got = _serve({**INFO, "/dora/import_kv": {"success": True, "tokens": 37},
                  "/dora/release_kv": {"success": True, "released": True},
                  "/dora/draft_sources": {"success": True, "added": False},
                  "/dora/weights_checksum": {"checksum": "ab" * 32, "weight_version": "3"}}, calls)
    assert got == (37, True, False, "ab" * 32)


@pytest.mark.parametrize("path, answer, call, field", [
    ("/dora/import_kv", {"tokens": "37"}, lambda c: c.import_kv(b"blob"), "tokens must be an integer, got '37'"),
    ("/dora/import_kv", {"success": True}, lambda c: c.import_kv(b"blob"), "missing field tokens"),
    ("/dora/release_kv", {"released": 1}, lambda c: c.release_kv("r1"), "released must be a boolean, got 1"),
    ("/dora/weights_checksum", {"checksum": None}, lambda c: c.weights_checksum(), "checksum must be a string, got None"),
])
def test_a_malformed_extension_answer_names_the_route_and_the_field(path, answer, call, field):
    with pytest.raises(ProtocolError) as err:
        _serve({**INFO, path: answer}, call)
    assert path in err.value.message and field in err.value.message, err.value.message


def test_a_malformed_extension_list_names_the_field():
    with pytest.raises(ProtocolError) as err:
        _serve({"/get_server_info": {"dora_extensions": "keep_kv"}}, lambda c: c.supports("keep_kv"))
    assert "/get_server_info" in err.value.message and "dora_extensions must be a list, got 'keep_kv'" in err.value.message


def test_a_control_route_answering_no_object_is_refused_by_name():
    with pytest.raises(ProtocolError) as err:
        _serve({"/pause_generation": ["paused"]}, lambda c: c.pause())
    assert "/pause_generation" in err.value.message and "list" in err.value.message


def test_a_load_report_that_is_no_number_names_the_field():
    with pytest.raises(ProtocolError) as err:
        summarize_loads({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": {"n": 2}}]})
    assert "num_waiting_reqs" in err.value.message
    # numbers, numeric strings and absent fields are read as before
    got = summarize_loads({"loads": [{"num_running_reqs": "2", "num_waiting_reqs": None, "token_usage": 0.5}]})
    assert got == {"num_running_reqs": 2, "num_waiting_reqs": 0, "kv_usage": 0.5}
