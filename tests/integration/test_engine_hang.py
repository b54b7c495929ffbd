"""A hung engine (SIGSTOP: the socket still accepts, nothing answers) is detected by client timeouts.

``EngineClient.health()`` must return False (not wait) and ``generate`` must raise a
``TimeoutError`` once the client's ``timeout_s`` passes; after SIGCONT the same engine must be
healthy again, must have dropped the request whose client gave up, and must generate correctly.
A generous outer ``asyncio.wait_for`` turns a missing client timeout into a test failure instead
of a hang. The child is always continued and stopped in ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from dora_megatron.comm.engine_client import EngineClient

pytestmark = pytest.mark.integration

PROMPT = [4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
HEALTH_TIMEOUT_S = 1.0
GENERATE_TIMEOUT_S = 2.0
LIVE_TIMEOUT_S = 60.0
GUARD_S = 30.0  # far above both timeouts: reaching it means the client did not time out


@pytest.fixture(scope="module")
def engine(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    ep = start_engine(model_dir, max_running=2, num_threads=1)
    try:
        yield ep
    finally:
        if ep.proc.poll() is None:
            os.kill(ep.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        ep.stop()


async def guarded(coro) -> "asyncio.Task":
    """Run ``coro`` for at most GUARD_S; fail (instead of hanging) if it has not finished by then."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=GUARD_S)
    if not done:
        task.cancel()
        raise AssertionError(f"no answer and no client timeout after {GUARD_S} s")
    return task


def test_stopped_engine_times_out_then_recovers(engine):
    async def go():
        # the short timeouts are for the calls made while the engine is stopped; the engine's first
        # forward and the answers after it runs again get a bound a loaded machine cannot reach
        async with EngineClient(engine.url, timeout_s=GENERATE_TIMEOUT_S) as c, \
                EngineClient(engine.url, timeout_s=LIVE_TIMEOUT_S) as live:
            reference = await live.generate(PROMPT, GREEDY, rid="before")
            assert await live.health(timeout_s=LIVE_TIMEOUT_S)
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                healthy = (await guarded(c.health(timeout_s=HEALTH_TIMEOUT_S))).result()
                gen = await guarded(c.generate(PROMPT, GREEDY, rid="during"))
                info_stopped = await guarded(c.server_info())
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            recovered = (await guarded(c.wait_healthy(timeout_s=20))).result()
            after = await live.generate(PROMPT, GREEDY, rid="after")
            for _ in range(500):  # the abandoned request is dropped or finished once the engine runs again
                info = await c.server_info()
                if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                    break
                await asyncio.sleep(0.02)
            return reference, healthy, gen.exception(), info_stopped.exception(), recovered, after, info

    reference, healthy, gen_exc, info_exc, recovered, after, info = asyncio.run(go())
    assert healthy is False
    assert isinstance(gen_exc, TimeoutError), repr(gen_exc)  # the client's own timeout_s fired
    assert isinstance(info_exc, TimeoutError), repr(info_exc)
    assert recovered is None
    assert after.output_ids == reference.output_ids and after.finish_type == "length"
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_blocks_used"] == 0
    assert engine.proc.poll() is None
