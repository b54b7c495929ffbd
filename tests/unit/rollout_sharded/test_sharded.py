"""Engine clients in worker processes (``rollout.client_workers``): the runtime must see exactly
what an in-process client would show it, and a dead worker as failed instances, never a hang.

Real worker processes (:mod:`dora_megatron.rollout.shard_worker`) against a small SGLang-shaped
HTTP fake in this process, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import aiohttp
import pytest
from aiohttp import web

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.controller.errors import is_comm_error
from dora_megatron.comm.engine_client import EngineError, ProbeUnavailable, VersionMismatch
from dora_megatron.rollout.sharded import ClientPool
from dora_megatron.rollout.wire import decode_error, encode_error


def _app(seen: dict) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.setdefault("rids", []).append(body["rid"])
        if body["sampling_params"]["max_new_tokens"] == 99:  # hangs until the client goes away
            seen["hanging"] = True
            for _ in range(3000):
                if request.transport is None or request.transport.is_closing():
                    seen["hang_cancelled"] = True
                    break
                await asyncio.sleep(0.02)
            return web.json_response({"message": "hung"}, status=500)
        version = "3" if body["sampling_params"]["max_new_tokens"] == 7 else "0"
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                "completion_tokens": 2, "weight_version": version,
                "weight_versions": [{"version": version, "start": 0, "end": 2}],
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}
        return web.json_response({"output_ids": [5, 6], "meta_info": meta})

    async def loads(request: web.Request) -> web.Response:
        seen["polls"] = seen.get("polls", 0) + 1
        if seen.get("loads_fail"):
            return web.json_response({"message": "broken"}, status=500)
        return web.json_response({"version": "0.5.23", "loads": [{"num_running_reqs": 2, "num_waiting_reqs": 0,
                                  "num_used_tokens": 10, "max_total_num_tokens": 100, "token_usage": 0.1}]})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/loads", loads)
    return app


async def _serve(seen: dict) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(_app(seen))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _cfg():
    return load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", "rollout.client_workers=1"])


async def _with_pool(body, workers: int = 1, poll: dict | None = None):
    seen: dict = {}
    runner, url = await _serve(seen)
    pool = await ClientPool.start(_cfg(), "/nonexistent", workers, poll=poll)
    try:
        return await asyncio.wait_for(body(pool, url, seen), timeout=60)
    finally:
        await pool.close()
        await runner.cleanup()


def test_generate_runs_in_the_worker_with_sglang_semantics():
    async def body(pool, url, seen):
        e = pool.engine(url)
        resp = await e.generate([1, 2, 3], {"max_new_tokens": 4}, rid="s1", version=0)
        assert resp.rid == "s1" and resp.output_ids == [5, 6] and resp.output_token_logprobs == [-0.5, -0.25]
        assert resp.versions_used == ["0"] and resp.raw == {}  # the raw JSON is not shipped back
        assert seen["rids"] == ["s1#"]  # SGLang's prefix-free wire rid: the real adapter ran in the worker
        with pytest.raises(VersionMismatch):  # the adapter's C1 check, rebuilt as the runtime's class
            await e.generate([1], {"max_new_tokens": 7}, rid="s2", version=0)
        assert await e.supports("export_request") is False
    asyncio.run(_with_pool(body))


def test_errors_keep_the_class_the_runtime_decides_on():
    for err in (EngineError("u", 503, "down"), VersionMismatch("u", 409, "version 2"),
                ProbeUnavailable("u", 404, "Not Found"), asyncio.TimeoutError(),
                aiohttp.ClientConnectionError("refused"), ConnectionResetError("reset")):
        back = decode_error(encode_error(err))
        assert is_comm_error(back), (err, back)
        if isinstance(err, EngineError):
            assert type(back) is type(err) and back.status == err.status and back.message == err.message
    bug = decode_error(encode_error(KeyError("x")))
    assert isinstance(bug, RuntimeError) and not is_comm_error(bug)  # a bug is no engine failure


async def _until(seen: dict, key: str, within_s: float) -> bool:
    """Whether ``seen[key]`` became true within ``within_s``: a bounded wait whose result the test
    asserts, so a broken path fails fast with its own message instead of hanging."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not seen.get(key):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_cancelled_call_is_cancelled_in_the_worker():
    async def body(pool, url, seen):
        e = pool.engine(url)
        task = asyncio.get_running_loop().create_task(e.generate([1], {"max_new_tokens": 99}, rid="h"))
        assert await _until(seen, "hanging", 20.0), "the call never reached the server"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the worker closed the HTTP request: the server saw it go (it would otherwise hold it 60 s)
        assert await _until(seen, "hang_cancelled", 10.0), "the worker kept the cancelled call's request open"
        assert seen["rids"] == ["h#"]  # the one call, not retried after its cancel
    asyncio.run(_with_pool(body))


def test_load_reports_are_pushed_and_a_broken_instance_reported_failed():
    async def body(pool, url, seen):
        e = pool.engine(url)
        assert pool.covers(e) and not pool.covers(object())
        while not (reports := pool.take_reports()):
            await asyncio.sleep(0.01)
        assert reports[e]["num_running_reqs"] == 2 and reports[e]["kv_usage"] == pytest.approx(0.1)
        seen["loads_fail"] = True
        while not isinstance((reports := pool.take_reports()).get(e), tuple):
            await asyncio.sleep(0.01)
        assert reports[e][0] == "failed" and "500" in reports[e][1]
    asyncio.run(_with_pool(body, poll={"interval_s": 0.02, "health_timeout_s": 5.0, "concurrency": 4}))


def test_a_killed_worker_fails_its_calls_and_instances_at_once():
    async def body(pool, url, seen):
        e0, e1 = pool.engine(url), pool.engine(url)  # one per worker
        assert e0.worker_pid != e1.worker_pid
        hanging = asyncio.get_running_loop().create_task(e0.generate([1], {"max_new_tokens": 99}, rid="h"))
        while "hanging" not in seen:
            await asyncio.sleep(0.01)
        os.kill(e0.worker_pid, signal.SIGKILL)
        with pytest.raises(ConnectionError, match="exited"):
            await hanging
        with pytest.raises(ConnectionError):  # later calls fail at once, no wait for a timeout
            await e0.generate([1], {"max_new_tokens": 4}, rid="late")
        reports = pool.take_reports()
        assert reports[e0][0] == "failed" and e1 not in reports
        assert (await e1.generate([1], {"max_new_tokens": 4}, rid="other")).output_ids == [5, 6]
    asyncio.run(_with_pool(body, workers=2))


@pytest.mark.parametrize("override", [["rollout.client_workers=-1"],
                                      ["rollout.engine=vllm", "rollout.client_workers=2"]])
def test_client_workers_is_validated(override):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert err.value.path == "rollout.client_workers", str(err.value)
