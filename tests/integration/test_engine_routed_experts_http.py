"""routed_experts over HTTP from a real embedded-engine process (client -> /generate -> meta_info),
in bf16 (rollout.dtype) and decoded as SGLang's clients decode it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dora_megatron.comm.engine_client import EngineClient

pytestmark = pytest.mark.integration

PROMPT = [5, 20, 30, 7, 9, 11]


@pytest.fixture(scope="module")
def engine(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    ep = start_engine(model_dir, max_running=2, num_threads=1, extra_args=("--dtype", "bfloat16"))
    yield ep
    ep.stop()


def test_generate_returns_routed_experts_for_the_whole_sequence(engine, model_dir):
    from dora_megatron.models.hf_config import read_spec

    spec = read_spec(model_dir)

    async def main():
        async with EngineClient(engine.url) as c:
            with_r = await c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
                                      routed_experts=True)
            plain = await c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True})
            return with_r, plain

    with_r, plain = asyncio.run(main())
    routed = with_r.raw["meta_info"]["routed_experts"]  # the client decodes SGLang's base64 (comm.generate_codec)
    assert routed.dtype == np.int8  # the smallest type that holds the model's expert ids
    rows = routed.reshape(-1, spec.num_layers, spec.top_k)
    assert rows.shape[0] == len(PROMPT) + len(with_r.output_ids) - 1
    assert rows.min() >= 0 and rows.max() < spec.num_experts
    assert "routed_experts" not in plain.raw["meta_info"] and plain.output_ids == with_r.output_ids
