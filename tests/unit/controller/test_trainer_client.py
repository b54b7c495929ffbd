"""Trainer client errors: no answer (the process is likely gone) vs an error the trainer reported."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.controller.trainer_client import TrainerClient, TrainerError, TrainerUnreachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_answer_is_unreachable():
    async def go():
        client = TrainerClient(f"http://127.0.0.1:{_closed_port()}")
        try:
            await client.train(0, [])
        finally:
            await client.close()

    with pytest.raises(TrainerUnreachable, match="/train: no answer from http://127.0.0.1:"):
        asyncio.run(go())


def test_reported_error_is_a_trainer_error_with_its_message():
    async def fail(request):
        return web.json_response({"error": "RuntimeError: loss is nan"}, status=500)

    async def go():
        app = web.Application()
        app.router.add_post("/train", fail)
        async with TestServer(app, host="127.0.0.1") as server:
            client = TrainerClient(str(server.make_url("")))
            try:
                with pytest.raises(TrainerError, match="HTTP 500: RuntimeError: loss is nan") as info:
                    await client.train(0, [])
                assert not isinstance(info.value, TrainerUnreachable)
            finally:
                await client.close()

    asyncio.run(go())
