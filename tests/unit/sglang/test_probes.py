"""The SGLang client tells a probe that cannot run on a server (no such route or action: 404, 405,
501, SGLang's ``Unsupported action`` reply) from one that ran and failed, for every optional probe:
``/weights_checker``, ``/model_info``, ``/v1/loads`` (loads and version); and the push's version
check takes an unavailable ``/model_info`` as unverified, not wrong."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import EngineError, ProbeUnavailable, VersionMismatch, probe_unavailable
from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.weights.distributed import pushed_versions


def _serve(routes: dict[tuple[str, str], tuple[int, Any]], fn: Callable[[SGLangClient], Any]) -> None:
    """Run ``fn(client)`` against a server answering ``(method, path) -> (status, JSON body)``;
    every other route is aiohttp's own 404/405."""

    def handler(status: int, body: Any):
        async def h(request: web.Request) -> web.Response:
            return web.json_response(body, status=status)
        return h

    app = web.Application()
    for (method, path), (status, body) in routes.items():
        app.router.add_route(method, path, handler(status, body))

    async def go():
        async with TestServer(app) as server:
            client = SGLangClient(str(server.make_url("")).rstrip("/"), timeout_s=10)
            try:
                await fn(client)
            finally:
                await client.close()

    asyncio.run(go())


@pytest.mark.parametrize("status,message,unavailable", [
    (404, "Not Found", True), (405, "Method Not Allowed", True), (501, "Not Implemented", True),
    (400, "Unsupported action='checksum'", True), (422, "action not supported", True),
    (400, "Flush cache failed.", False), (500, "CUDA error", False), (503, "overloaded", False),
])
def test_the_classification_of_replies(status, message, unavailable):
    assert probe_unavailable(EngineError("http://x/p", status, message)) is unavailable
    assert not probe_unavailable(VersionMismatch("http://x/p", 409, "weight version 1 != 2"))
    assert not probe_unavailable(OSError("connection refused"))


def test_a_server_without_weights_checker_raises_probe_unavailable():
    async def check(c: SGLangClient) -> None:
        with pytest.raises(ProbeUnavailable):
            await c.instance_checksum()

    _serve({}, check)  # no route: aiohttp's 404


def test_an_unsupported_checksum_action_raises_probe_unavailable():
    async def check(c: SGLangClient) -> None:
        with pytest.raises(ProbeUnavailable):
            await c.instance_checksum()

    _serve({("POST", "/weights_checker"): (400, {"success": False, "message": "Unsupported action='checksum'"})},
           check)


def test_a_broken_weights_checker_is_not_unavailable():
    async def check(c: SGLangClient) -> None:
        with pytest.raises(EngineError) as err:
            await c.instance_checksum()
        assert not isinstance(err.value, ProbeUnavailable) and err.value.status == 500

    _serve({("POST", "/weights_checker"): (500, {"message": "CUDA error"})}, check)


def test_a_server_without_model_info_raises_probe_unavailable():
    async def check(c: SGLangClient) -> None:
        with pytest.raises(ProbeUnavailable):
            await c.weight_version()

    _serve({("GET", "/model_info"): (501, {"message": "not implemented"})}, check)


def test_a_server_without_v1_loads_is_alive_with_no_load_report(caplog):
    caplog.set_level(logging.WARNING, logger="dora_megatron.comm.sglang_client")

    async def check(c: SGLangClient) -> None:
        assert await c.loads() is None
        assert await c.server_version() is None
        for _ in range(3):
            assert await c.server_info() == {"loads_unavailable": True}

    _serve({("GET", "/health"): (200, {})}, check)
    assert len([r for r in caplog.records if "/v1/loads" in r.getMessage()]) == 1  # one warning per instance


def test_a_server_without_v1_loads_and_without_health_is_failed():
    async def check(c: SGLangClient) -> None:
        with pytest.raises(EngineError):
            await c.server_info()

    _serve({("GET", "/health"): (503, {"message": "unhealthy"})}, check)


def test_a_push_is_unverified_not_wrong_where_the_version_cannot_be_read():
    got = [ProbeUnavailable("http://a/model_info", 404, "Not Found"), "3", "2",
           EngineError("http://d/model_info", 500, "boom")]
    versions, wrong = pushed_versions(["a", "b", "c", "d"], got, 3)
    assert versions["a"] == "unverified" and versions["b"] == "3"
    assert set(wrong) == {"c", "d"}
