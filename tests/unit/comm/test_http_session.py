"""The one session holder of the HTTP clients: made lazily, closed only when owned, limits applied."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import EngineClient
from dora_megatron.comm.http_session import HttpSession
from dora_megatron.controller.trainer_client import TrainerClient
from dora_megatron.rollout.vllm.client import VLLMClient


def test_owned_session_is_made_lazily_with_its_limit_and_closed():
    async def go():
        http = HttpSession(7.0, limit=3)
        first = http.session()
        same = http.session() is first
        limit, total = first.connector.limit, first.timeout.total
        await http.close()
        again = http.session()
        fresh = again is not first and not again.closed
        await http.close()
        return same, limit, total, first.closed, fresh

    assert asyncio.run(go()) == (True, 3, 7.0, True, True)


def test_borrowed_session_stays_open_and_call_timeout_overrides_the_default():
    async def go():
        async with aiohttp.ClientSession() as shared:
            async with HttpSession(9.0, session=shared) as http:
                got = http.session() is shared
            return got, shared.closed, http.call_timeout(None).total, http.call_timeout(2.0).total

    assert asyncio.run(go()) == (True, False, 9.0, 2.0)


def test_negative_limit_is_refused_with_its_value():
    with pytest.raises(ValueError, match="limit must be >= 0.*-1"):
        HttpSession(limit=-1)


def test_every_client_closes_its_own_session_only():
    """EngineClient, VLLMClient and TrainerClient share the holder: each closes what it made, and an
    EngineClient given a shared session leaves it open for the others."""
    async def ok(_req):
        return web.json_response({"status": "ok"})

    async def go():
        app = web.Application()
        app.router.add_get("/health", ok)
        async with TestServer(app, host="127.0.0.1") as server:
            url = str(server.make_url("")).rstrip("/")
            async with aiohttp.ClientSession() as shared:
                borrowed = EngineClient(url, session=shared)
                own = [EngineClient(url), VLLMClient(url), TrainerClient(url)]
                answers = [await borrowed.health()] + [bool(await c.health()) for c in own]
                sessions = [c._http.session() for c in own]
                await borrowed.close()
                for c in own:
                    await c.close()
                return answers, shared.closed, [s.closed for s in sessions]

    assert asyncio.run(go()) == ([True, True, True, True], False, [True, True, True])


def test_json_bodies_are_encoded_compactly_with_string_keys():
    """``json=`` bodies go through orjson (compact, no spaces as ``json.dumps`` writes them), typed as
    JSON, and non-string keys become strings as ``json.dumps`` makes them: the receiver reads the
    same values."""
    import json

    seen: dict[str, object] = {}

    async def echo(req: web.Request) -> web.Response:
        seen["type"] = req.content_type
        seen["raw"] = await req.read()
        return web.json_response({"ok": True})

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/x", echo)
        async with TestServer(app, host="127.0.0.1") as server:
            async with HttpSession(5.0) as http:
                async with http.session().post(server.make_url("/x"), json={"input_ids": list(range(5000)),
                                                                           "spans": {3: [1, 2]}, "t": 0.5}) as r:
                    assert r.status == 200

    asyncio.run(go())
    raw = seen["raw"]
    assert isinstance(raw, bytes)
    assert seen["type"] == "application/json"
    assert b" " not in raw  # json.dumps would have written ", " between the 5,000 ids
    assert json.loads(raw) == {"input_ids": list(range(5000)), "spans": {"3": [1, 2]}, "t": 0.5}


def test_json_encoder_takes_what_json_dumps_takes() -> None:
    import json

    import numpy as np

    from dora_megatron.comm.http_session import encode_json

    class Weight(float):
        pass

    value = {"a": np.float64(0.25), "b": np.int64(3), "c": Weight(1.5), 7: (1, 2), "d": np.arange(3, dtype=np.int32)}
    assert json.loads(encode_json(value)) == {"a": 0.25, "b": 3, "c": 1.5, "7": [1, 2], "d": [0, 1, 2]}
    with pytest.raises(TypeError, match="JSON serializable: set"):
        encode_json({"x": {1, 2}})
