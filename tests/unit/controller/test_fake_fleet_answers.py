"""``tools/fake_fleet.py``'s routed-expert answers, read back by the controller's own decoder: the
harness that measures the data plane at production lengths must send what SGLang sends (base64 of
int32 ids, ``(positions, layers, top_k)``), cut from a pool it encoded once."""

from __future__ import annotations

import numpy as np
import pytest

from dora_megatron.comm.generate_codec import parse_generate
from tests.helpers.tools import load_tool

fleet_tool = load_tool("fake_fleet")


def fleet(layers: int, top_k: int, num_experts: int = 16, max_tokens: int = 64):
    return fleet_tool.Fleet([1], 0.001, 8, 1.5, 0.0, 1024, (layers, top_k), num_experts, max_tokens)


def is_window_of(ids: np.ndarray, pool: np.ndarray) -> bool:
    """Whether ``ids`` is a contiguous run of ``pool`` (the answer is a window of the fleet's pool)."""
    n = len(ids)
    return any(np.array_equal(pool[i:i + n], ids) for i in range(len(pool) - n + 1))


@pytest.mark.parametrize("layers,top_k", [(48, 8), (2, 1), (3, 5), (1, 1)])
@pytest.mark.parametrize("positions", [1, 2, 7, 63])
def test_an_answer_decodes_to_a_window_of_the_pool_for_any_shape(layers, top_k, positions):
    f = fleet(layers, top_k)
    pool = np.frombuffer(f.routed_pool, dtype="<i4")
    meta = {"id": "r", "output_token_logprobs": [[-0.5, 3, None]] * 4}
    for seed in (0, 1, 12345):
        resp = parse_generate(b"".join(f.answer(4, meta, f.routed_experts(seed, positions))))
        experts = np.asarray(resp.raw["meta_info"]["routed_experts"])
        assert experts.size == positions * layers * top_k
        assert is_window_of(experts.reshape(-1).astype("<i4"), pool)
        assert experts.max() < 16 and experts.min() >= 0
        assert resp.output_token_logprobs == [-0.5] * 4


def test_different_seeds_get_different_windows():
    f = fleet(4, 2, max_tokens=512)
    texts = {b"".join(f.routed_experts(seed, 10)) for seed in range(8)}
    assert len(texts) > 1


def test_an_answer_without_routed_experts_is_plain_json():
    f = fleet(4, 2)
    resp = parse_generate(b"".join(f.answer(2, {"id": "r"}, None)))
    assert resp.output_ids == [f.token, f.token]
    assert "routed_experts" not in resp.raw["meta_info"]


def test_a_streamed_answer_over_http_reads_back_whole():
    """The answer as the controller's client reads it off a socket: streamed in pieces, whole."""
    import asyncio

    from aiohttp import web

    from dora_megatron.comm.engine_client import EngineClient

    async def run() -> tuple[object, np.ndarray]:
        socks = fleet_tool._listen(1)
        port = socks[0].getsockname()[1]
        f = fleet_tool.Fleet([port], 0.0001, 1500, 1.5, 0.0, 1024, (48, 8), 16, 4096)
        runner = web.AppRunner(f.app(), access_log=None, handle_signals=False)
        await runner.setup()
        await web.SockSite(runner, socks[0]).start()
        try:
            async with EngineClient(f"http://127.0.0.1:{port}", timeout_s=30) as client:
                resp = await client.generate([1, 2, 3], {"max_new_tokens": 2000, "sampling_seed": 5},
                                             routed_experts=True)
        finally:
            await runner.cleanup()
        return resp, np.frombuffer(f.routed_pool, dtype="<i4")

    resp, pool = asyncio.run(run())
    n = len(resp.output_ids)
    experts = np.asarray(resp.raw["meta_info"]["routed_experts"]).reshape(-1).astype("<i4")
    assert experts.size == (3 + n - 1) * 48 * 8 > fleet_tool.ANSWER_CHUNK // 4  # more than one write
    assert is_window_of(experts[:4096], pool) and is_window_of(experts[-4096:], pool)
