"""2,000 concurrent ``/generate`` calls against one engine process with a small ``--max-running``.

Every request must either complete with the right tokens or be refused at once with 429 and a
message: none lost, no other 5xx, no hang (an overall timeout guards each burst). The queue is
bounded by ``--max-waiting``; with generation paused the outcome is exact (the first
``MAX_WAITING`` arrivals queue, all others get 429). Memory: the engine process's RSS may grow
by at most ``RSS_GROWTH_MIB`` over two bursts, and the second burst must not grow it further
than ``RSS_LEAK_MIB`` (what a per-request leak would break).

Client side: one socket per request on loopback (the fd limit is raised for this process and
the engine it spawns, which inherits it); if the hard limit is too low the client falls back to
a bounded pool.
"""

from __future__ import annotations

import asyncio
import json
import resource

import aiohttp
import pytest

from dora_megatron.comm.engine_client import EngineClient

pytestmark = pytest.mark.integration

N = 2000
MAX_RUNNING = 4
MAX_WAITING = 300
PROMPTS = [[5 + i, 9, 13 + 2 * i] for i in range(16)]
SP = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
BURST_TIMEOUT_S = 120.0
# Growth bound over both bursts. Justification: the engine holds at most MAX_RUNNING + MAX_WAITING
# requests (a few KB each: ids, Request, future, aiohttp request) plus up to N open connections
# (aiohttp transport + protocol + small read buffer, well under 64 KiB each: N * 64 KiB = 125 MiB)
# and KV for MAX_RUNNING requests of 7 tokens (KBs). An unbounded queue or a per-request leak of
# KV or responses over 4,000 requests would exceed it; allocator caching keeps some of the peak.
RSS_GROWTH_MIB = 160
RSS_LEAK_MIB = 48  # the second, identical burst reuses the memory of the first


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def connections() -> int:
    """Raise the soft fd limit (inherited by the engine child); return the client's socket budget."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = N + 512
    target = want if hard == resource.RLIM_INFINITY else min(hard, max(soft, want))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
    return N if target >= want else max(64, target - 256)  # else: a bounded pool


@pytest.fixture(scope="module")
def engine(model_dir, connections):
    from dora_megatron.rollout.engine.process import start_engine

    ep = start_engine(model_dir, max_running=MAX_RUNNING, num_threads=1, extra_args=["--max-waiting", str(MAX_WAITING)])
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def rss_log() -> dict[str, float]:
    """RSS of the engine (MiB) recorded by the tests, in order."""
    return {}


@pytest.fixture(scope="module")
def reference(engine):
    async def go():
        async with EngineClient(engine.url, timeout_s=60) as c:
            return [(await c.generate(p, SP)).output_ids for p in PROMPTS]

    return asyncio.run(go())


async def burst(url: str, connections: int, on_answer=None) -> list[tuple[int, int, dict]]:
    """N concurrent requests; returns (index, status, body) for each; raises on a hang."""
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=BURST_TIMEOUT_S)) as s:

        async def one(i: int):
            body = {"input_ids": PROMPTS[i % len(PROMPTS)], "sampling_params": SP, "rid": f"load-{i}"}
            async with s.post(url + "/generate", json=body) as r:
                out = (i, r.status, json.loads(await r.read()))
            if on_answer is not None:
                on_answer(out)
            return out

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N))), BURST_TIMEOUT_S)


def check_answers(answers, reference) -> tuple[int, int]:
    """Every answer is a correct completion or a 429 with a message; returns (completed, refused)."""
    assert sorted(i for i, _, _ in answers) == list(range(N))  # nothing lost
    ok = refused = 0
    for i, status, body in answers:
        if status == 200:
            assert body["meta_info"]["id"] == f"load-{i}"
            assert body["output_ids"] == reference[i % len(PROMPTS)], (i, body)
            ok += 1
        else:
            assert status == 429, (i, status, body)
            assert body["success"] is False and "overloaded" in body["message"]
            refused += 1
    return ok, refused


async def wait_idle(c: EngineClient) -> dict:
    for _ in range(1000):
        info = await c.server_info()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {info}")


def test_paused_burst_queues_exactly_max_waiting_and_refuses_the_rest(engine, reference, connections, rss_log):
    rss_log["before"] = rss_mib(engine.pid)
    refused_early = []

    async def go():
        async with EngineClient(engine.url, timeout_s=60) as c:
            await c.pause("in_place")
            try:
                task = asyncio.create_task(
                    burst(engine.url, connections, lambda a: refused_early.append(a) if a[1] != 200 else None)
                )
                for _ in range(3000):  # all arrivals handled: MAX_WAITING queued, the rest answered 429
                    info = await c.server_info()
                    if len(refused_early) == N - MAX_WAITING and info["num_waiting_reqs"] == MAX_WAITING:
                        break
                    assert not task.done()
                    await asyncio.sleep(0.02)
                queued_while_paused = info["num_waiting_reqs"]
            finally:
                await c.continue_generation()
            answers = await task
            return answers, queued_while_paused, await wait_idle(c)

    answers, queued, info = asyncio.run(go())
    ok, refused = check_answers(answers, reference)
    assert (ok, refused, queued) == (MAX_WAITING, N - MAX_WAITING, MAX_WAITING)
    assert info["kv_blocks_used"] == 0
    rss_log["after_paused_burst"] = rss_mib(engine.pid)


def test_unpaused_bursts_complete_or_refuse_and_memory_stays_bounded(engine, reference, connections, rss_log):
    peaks = []

    async def one_burst():
        async with EngineClient(engine.url, timeout_s=60) as c:
            stop = asyncio.Event()

            async def watch():  # the queue never exceeds its bound
                while not stop.is_set():
                    peaks.append((await c.server_info())["num_waiting_reqs"])
                    await asyncio.sleep(0.05)

            w = asyncio.create_task(watch())
            try:
                answers = await burst(engine.url, connections)
            finally:
                stop.set()
                await w
            return answers, await wait_idle(c)

    results = []
    rss = []
    for _ in range(2):
        answers, info = asyncio.run(one_burst())
        results.append(check_answers(answers, reference))
        assert info["kv_blocks_used"] == 0
        rss.append(rss_mib(engine.pid))
    assert all(ok > 0 and ok + refused == N for ok, refused in results), results
    assert max(peaks) <= MAX_WAITING
    assert engine.proc.poll() is None
    rss_log.update(after_burst_1=rss[0], after_burst_2=rss[1])
    before = rss_log.get("before", rss[0])
    assert rss[1] - before < RSS_GROWTH_MIB, rss_log
    assert rss[1] - rss[0] < RSS_LEAK_MIB, rss_log
    print("engine RSS MiB:", {k: round(v, 1) for k, v in rss_log.items()}, "outcomes (ok, 429):", results)
