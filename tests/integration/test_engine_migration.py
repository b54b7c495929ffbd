"""Migration between two engine processes: export mid-generation, import elsewhere, same result."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.models import make_tiny_moe

from dora_megatron.comm.engine_client import EngineClient, ExtensionUnsupported

pytestmark = pytest.mark.integration

PROMPT = [7, 8, 9, 40, 41, 42] * 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("moe"), seed=3)


@pytest.fixture(scope="module")
def engines(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    a = start_engine(model_dir, max_running=4, num_threads=1, weight_version="2")
    try:
        b = start_engine(model_dir, max_running=4, num_threads=1, weight_version="2")
    except Exception:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


async def _migrate_once(a: EngineClient, b: EngineClient, sp: dict, rid: str):
    task = asyncio.create_task(a.generate(PROMPT, sp, rid=rid, version=2))
    for _ in range(2000):
        if (await a.server_info())["tokens_generated"] > 0 and (await a.server_info())["num_running_reqs"] == 1:
            break
        await asyncio.sleep(0.005)
    await a.pause("in_place")
    blob = await a.export_request(rid)
    await a.continue_generation()
    src = await task
    dst = await b.import_request(blob)
    return src, dst, len(blob)


@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True},
        {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 77, "max_new_tokens": 200, "ignore_eos": True},
    ],
    ids=["greedy", "seeded"],
)
def test_migrated_request_equals_unmigrated(engines, sp):
    ea, eb = engines

    async def go():
        async with EngineClient(ea.url) as a, EngineClient(eb.url) as b:
            ref = await a.generate(PROMPT, sp, rid="ref-" + str(sp["temperature"]))
            src, dst, nbytes = await _migrate_once(a, b, sp, "mig-" + str(sp["temperature"]))
            info_b = await b.server_info()
            return ref, src, dst, nbytes, info_b

    ref, src, dst, nbytes, info_b = asyncio.run(go())
    assert src.migrated and src.finish_type == "abort"
    assert 0 < len(src.output_ids) < 200
    assert src.output_ids == ref.output_ids[: len(src.output_ids)]
    assert dst.output_ids == ref.output_ids
    assert dst.output_token_logprobs == ref.output_token_logprobs  # exact: no re-prefill, same RNG stream
    assert dst.raw["meta_info"]["dora_migrations"] == 1 and dst.weight_version == "2"
    assert nbytes > 4 * 2 * 2 * 32 * 4 * len(PROMPT)  # the KV travelled
    assert info_b["num_running_reqs"] == 0 and info_b["kv_blocks_used"] == 0


def test_client_falls_back_when_engine_lacks_extensions():
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def go():
        app = web.Application()

        async def info(_):
            return web.json_response({"num_running_reqs": 0})  # an SGLang-like server: no dora_extensions

        app.router.add_get("/get_server_info", info)
        async with TestServer(app, host="127.0.0.1") as server:
            async with EngineClient(str(server.make_url("")).rstrip("/")) as c:
                assert not await c.supports("export_request")
                with pytest.raises(ExtensionUnsupported):
                    await c.export_request("x")
                with pytest.raises(ExtensionUnsupported):
                    await c.import_request(b"x")

    asyncio.run(go())
