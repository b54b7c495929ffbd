"""The embedded engine as a real process behind HTTP: generation, batching, control, errors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from dora_megatron.comm.engine_client import EngineClient, EngineError, VersionMismatch

pytestmark = pytest.mark.integration

PROMPTS = [[5 + i, 20 + 2 * i, 30] * (2 + i) for i in range(8)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    ep = start_engine(model_dir, max_running=4, num_threads=1, weight_version="7")
    yield ep
    ep.stop()


def call(coro_fn):
    async def main():
        return await coro_fn()

    return asyncio.run(main())


def raw_post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def wait_running(c: EngineClient, n: int) -> None:
    for _ in range(600):
        if (await c.server_info())["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("request never started running")


def test_greedy_matches_in_process_engine_and_logprobs(engine, model_dir):
    import torch

    from dora_megatron.rollout.engine.model import load_model
    from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
    from dora_megatron.comm.protocol import SamplingParams

    torch.set_num_threads(1)
    out = {}
    s = Scheduler(load_model(model_dir), SchedulerLimits(max_running=1))
    s.submit(Request("x", PROMPTS[0], SamplingParams(**GREEDY), True, lambda r: out.update(r)))
    while s.can_step():
        s.step()

    async def go():
        async with EngineClient(engine.url) as c:
            return await c.generate(PROMPTS[0], GREEDY, rid="greedy-1")

    r = call(go)
    assert r.output_ids == out["output_ids"]
    assert r.output_token_logprobs == pytest.approx([x[0] for x in out["meta_info"]["output_token_logprobs"]], abs=1e-5)
    # the engine answers [logprob, token_id, text] per token, as SGLang (the client parses them flat)
    assert out["meta_info"]["output_token_logprobs"][0][1] == r.output_ids[0]
    assert out["meta_info"]["output_token_logprobs"][0][2] is None
    assert r.finish_reason == {"type": "length", "length": 12}
    assert (r.rid, r.prompt_tokens, r.completion_tokens, r.weight_version) == ("greedy-1", len(PROMPTS[0]), 12, "7")


def test_concurrent_requests_equal_alone(engine):
    async def go():
        async with EngineClient(engine.url) as c:
            alone = [await c.generate(p, GREEDY) for p in PROMPTS]
            together = await asyncio.gather(*(c.generate(p, GREEDY) for p in PROMPTS))
            return alone, together

    alone, together = call(go)
    assert [a.output_ids for a in alone] == [t.output_ids for t in together]
    for a, t in zip(alone, together):
        assert t.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-4)


def test_server_stays_responsive_and_abort_returns_partial(engine):
    async def go():
        async with EngineClient(engine.url) as c:
            task = asyncio.create_task(c.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 3000}, rid="long-0001"))
            await wait_running(c, 1)
            info = await c.server_info()
            assert info["kv_usage"] > 0 and info["weight_version"] == "7" and info["max_running_requests"] == 4
            assert await c.health()
            assert await c.abort("long-0001")
            res = await task
            assert not await c.abort("long-0001")  # unknown now: 404 -> False
            return res

    res = call(go)
    assert res.finish_type == "abort"
    assert 0 < len(res.output_ids) < 3000 and len(res.output_token_logprobs) == len(res.output_ids)


def test_bad_requests_get_4xx_and_server_keeps_serving(engine):
    url = engine.url + "/generate"
    cases = [
        (b'{"input_ids": [1, 2', 400, "malformed JSON"),
        (b'{"sampling_params": {}}', 400, "missing field input_ids"),
        (b'{"input_ids": "hello"}', 400, "input_ids must be a list"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}', 400, "max_new_tokens"),
        (json.dumps({"input_ids": [5] * 5000}).encode(), 400, "context length"),
        (b'{"input_ids": [1], "dora_version": "3"}', 409, "holds version 7"),
    ]
    for body, status, needle in cases:
        code, resp = raw_post(url, body)
        assert code == status, (body[:40], resp)
        assert needle in resp["message"]
    code, resp = raw_post(engine.url + "/abort_request", b'{"rid": "no-such-rid"}')
    assert code == 404 and "no-such-rid" in resp["message"]
    code, resp = raw_post(engine.url + "/pause_generation", b'{"mode": "sleep"}')
    assert code == 400 and "mode" in resp["message"]
    code, resp = raw_post(engine.url + "/update_weights_from_distributed", b'{"names": [], "dtypes": [], "shapes": []}')
    assert code == 400 and "group" in resp["message"]

    async def go():
        async with EngineClient(engine.url) as c:
            with pytest.raises(VersionMismatch):
                await c.generate([1, 2], GREEDY, version=8)
            return await c.generate([1, 2], GREEDY, version=7)

    assert len(call(go).output_ids) == 12


def test_pause_modes_and_flush(engine):
    async def go():
        async with EngineClient(engine.url) as c:
            # long enough that the pauses land while it runs on a loaded machine
            ref = await c.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 400})
            task = asyncio.create_task(c.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 400}))
            await wait_running(c, 1)
            await c.pause("in_place")
            assert not await c.flush_cache()  # running requests: 400 like SGLang
            info = await c.server_info()
            assert info["paused"] == "in_place" and info["num_running_reqs"] == 1
            await c.continue_generation()
            await c.pause("retract")
            assert (await c.server_info())["num_running_reqs"] == 0
            await c.continue_generation()
            resumed = await task
            assert resumed.output_ids == ref.output_ids  # retracted then recomputed

            task = asyncio.create_task(c.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 3000}))
            await wait_running(c, 1)
            await c.pause("abort")
            aborted = await task
            late = asyncio.create_task(c.generate(PROMPTS[3], GREEDY))  # waits while paused
            for _ in range(500):  # until the engine has queued it (at most 10 s)
                if (await c.server_info())["num_waiting_reqs"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert not late.done() and (await c.server_info())["num_waiting_reqs"] == 1
            assert await c.flush_cache() is False  # a queued request blocks flush
            await c.continue_generation()
            done = await late
            assert await c.flush_cache()
            return aborted, done

    aborted, done = call(go)
    assert aborted.finish_type == "abort" and len(done.output_ids) == 12


def test_engine_error_carries_status(engine):
    async def go():
        async with EngineClient(engine.url) as c:
            with pytest.raises(EngineError) as e:
                await c.export_request("missing-rid")
            return e.value

    err = call(go)
    assert err.status == 404 and "missing-rid" in err.message


def test_client_disconnect_frees_the_slot(engine):
    async def go():
        async with EngineClient(engine.url) as c:
            task = asyncio.create_task(c.generate(PROMPTS[4], {**GREEDY, "max_new_tokens": 3000}))
            await wait_running(c, 1)
            task.cancel()  # closes the connection
            for _ in range(500):
                info = await c.server_info()
                if info["num_running_reqs"] == 0:
                    return info
                await asyncio.sleep(0.01)
            return info

    info = call(go)
    assert info["num_running_reqs"] == 0 and info["kv_blocks_used"] == 0
