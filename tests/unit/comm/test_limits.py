"""The controller's own limits (comm.limits): which errors are the controller's, how the pools are
sized from the open-files limit, the refusal naming its numbers, and the pools making excess
requests wait (counted) instead of failing."""

from __future__ import annotations

import asyncio
import errno
import resource

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.engine_client import EngineClient, EngineError
from dora_megatron.comm.limits import (CONTROL_CONNECTIONS, DESCRIPTOR_RESERVE, ConnectionBudgetError,
                                       ConnectionWaits, ControllerResourceError, local_resource_error,
                                       plan_connections, raise_open_files_limit)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL])
def test_local_shortages_are_the_controllers(code):
    err = OSError(code, "shortage")
    assert local_resource_error(err)
    # as aiohttp raises it on connect: the OSError kept in os_error
    conn_key = type("Key", (), {"ssl": False, "host": "127.0.0.1", "port": 1})()
    wrapped = aiohttp.ClientConnectorError(conn_key, err)
    assert local_resource_error(wrapped)
    # wrapped again further up (raise ... from)
    try:
        try:
            raise wrapped
        except aiohttp.ClientConnectorError as inner:
            raise RuntimeError("generate failed") from inner
    except RuntimeError as outer:
        assert local_resource_error(outer)


@pytest.mark.parametrize("err", [
    OSError(errno.ECONNREFUSED, "refused"), OSError(errno.ECONNRESET, "reset"), OSError(errno.EHOSTUNREACH, "x"),
    asyncio.TimeoutError(), EngineError("http://x", 500, "boom"), ConnectionError("worker gone"), None,
])
def test_an_instances_faults_are_not(err):
    assert not local_resource_error(err)


def test_pool_timeout_is_the_controllers():
    assert local_resource_error(ControllerResourceError("http://x", "no pooled connection"))


def test_plan_fits_one_connection_per_slot_when_the_limit_allows():
    plan = plan_connections(16, 8, 20_000)
    assert plan.fits and plan.generate == 8 and plan.control == CONTROL_CONNECTIONS
    assert plan.wanted == 16 * (8 + CONTROL_CONNECTIONS) + DESCRIPTOR_RESERVE


def test_plan_shrinks_the_pools_to_the_descriptors_left():
    # 4,096 instances x 8 slots on 20,000 open files: (20,000 - 128) // 4,096 = 4 each, 2 of them control
    plan = plan_connections(4096, 8, 20_000)
    assert not plan.fits
    assert plan.generate == (20_000 - DESCRIPTOR_RESERVE) // 4096 - CONTROL_CONNECTIONS == 2
    assert plan.instances * (plan.generate + plan.control) + plan.reserve <= 20_000
    text = plan.describe()
    assert "4096 instance(s) x 8 slot(s)" in text and "20000" in text and str(plan.wanted) in text


def test_client_workers_split_the_instances_over_processes():
    plan = plan_connections(4096, 8, 20_000, client_workers=4)  # 1,024 per process: 19 each
    assert plan.instances == 1024 and plan.fits and plan.generate == 8
    assert "rollout.client_workers=4" in plan.describe()
    assert plan_connections(10, 8, 20_000, client_workers=3).instances == 4  # ceil(10 / 3)


def test_refusal_names_the_numbers_and_the_key():
    # 16,384 instances x 8 slots, 20,000 open files: not one generate connection each
    with pytest.raises(ConnectionBudgetError) as info:
        plan_connections(16_384, 8, 20_000)
    msg = str(info.value)
    wanted = 16_384 * (8 + CONTROL_CONNECTIONS) + DESCRIPTOR_RESERVE
    need = 16_384 * (1 + CONTROL_CONNECTIONS) + DESCRIPTOR_RESERVE
    assert "16384 instance(s) x 8 slot(s)" in msg and str(wanted) in msg and str(need) in msg
    assert "20000" in msg and "rollout.client_workers" in msg and "now 0" in msg
    # the suggested worker count does fit
    suggested = int(msg.split("rollout.client_workers (at least ")[1].split(";")[0])
    assert plan_connections(16_384, 8, 20_000, client_workers=suggested).generate >= 1


def test_the_suggested_worker_count_is_the_least_that_fits():
    with pytest.raises(ConnectionBudgetError) as info:
        plan_connections(9000, 8, 20_000)  # (20,000 - 128) // 9,000 = 2 < 1 + 2
    suggested = int(str(info.value).split("rollout.client_workers (at least ")[1].split(";")[0])
    assert plan_connections(9000, 8, 20_000, client_workers=suggested).generate >= 1
    with pytest.raises(ConnectionBudgetError):
        plan_connections(9000, 8, 20_000, client_workers=suggested - 1)


def test_bad_inputs_are_refused_with_their_values():
    with pytest.raises(ValueError, match="slots=0"):
        plan_connections(4, 0, 1000)


def test_raise_open_files_limit_raises_the_soft_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 64)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        old, new = raise_open_files_limit()
        assert old == low and new == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert new == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_generates_beyond_the_plan_wait_and_are_counted_not_failed():
    """A pool of 2 generate connections, 6 generates at once: all 6 answer, at most 2 were on the
    wire at any time, the 4 others waited (counted), and a stats call still got through while they
    waited (the generates are held until it has answered: one stuck behind them never would)."""
    state = {"now": 0, "max": 0}

    async def generate(_req):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await state["release"].wait()
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return web.json_response({"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})

    async def loads(_req):
        return web.json_response({"ok": True})

    async def go():
        state["release"] = asyncio.Event()
        async with _engine_server(generate, loads) as server:
            waits = ConnectionWaits()
            plan = plan_connections(1, 8, DESCRIPTOR_RESERVE + 2 + CONTROL_CONNECTIONS)
            assert plan.generate == 2
            async with EngineClient(str(server.make_url("")), plan=plan, waits=waits) as client:
                gens = [asyncio.ensure_future(client.generate([1, 2], {"max_new_tokens": 1})) for _ in range(6)]
                await asyncio.sleep(0.01)
                info = await asyncio.wait_for(client.server_info(), timeout=10.0)  # not behind the generates
                state["release"].set()
                outs = await asyncio.gather(*gens)
            return len(outs), state["max"], waits.count, info

    n, peak, waited, info = asyncio.run(go())
    assert n == 6 and peak == 2 and waited == 4 and info == {"ok": True}


def _engine_server(generate, info) -> TestServer:
    """A loopback HTTP server answering ``/generate`` and ``/get_server_info`` with the handlers given."""
    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_server_info", info)
    return TestServer(app, host="127.0.0.1")


def test_a_call_that_times_out_waiting_for_a_pooled_connection_is_the_controllers():
    """A pool of one connection held by a long generate: a call that times out while queued for
    it raises ControllerResourceError (the pool's limit), not a timeout blamed on the instance."""
    async def generate(_req):
        await asyncio.sleep(0.5)
        return web.json_response({"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})

    async def info(_req):
        return web.json_response({})

    async def go():
        async with _engine_server(generate, info) as server:
            waits = ConnectionWaits()
            plan = plan_connections(1, 8, DESCRIPTOR_RESERVE + 1, control=0)
            async with EngineClient(str(server.make_url("")), plan=plan, waits=waits) as client:
                gen = asyncio.ensure_future(client.generate([1], {"max_new_tokens": 1}))
                await asyncio.sleep(0.05)
                with pytest.raises(ControllerResourceError) as info_err:
                    await client._request("GET", "/get_server_info", timeout_s=0.1)
                await gen
            return waits.count, info_err.value

    count, err = asyncio.run(go())
    assert count == 1 and local_resource_error(err) and "no pooled connection" in str(err)


def test_a_workers_local_error_crosses_the_wire_as_the_controllers():
    from dora_megatron.rollout.wire import decode_error, encode_error

    key = type("Key", (), {"ssl": False, "host": "127.0.0.1", "port": 1})()
    emfile = aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files"))
    back = decode_error(encode_error(emfile))
    assert isinstance(back, ControllerResourceError) and "Too many open files" in str(back)
    refused = decode_error(encode_error(aiohttp.ClientConnectorError(key, OSError(errno.ECONNREFUSED, "refused"))))
    assert not local_resource_error(refused)
