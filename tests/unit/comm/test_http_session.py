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
