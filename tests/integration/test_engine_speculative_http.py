"""`dora serve --speculative group` over HTTP: sibling drafts sent with /generate and pushed with
/dora/draft_sources are used (counters in /get_server_info and /v1/loads), greedy output unchanged."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.models import make_tiny_moe

from dora_megatron.comm.engine_client import EngineClient

pytestmark = pytest.mark.integration

PROMPT = [7, 8, 9, 40, 41, 42] * 5
GREEDY = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}


def test_group_drafts_over_http_keep_greedy_output(tmp_path):
    from dora_megatron.rollout.engine.model import load_model
    from dora_megatron.rollout.engine.process import start_engine
    from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
    from dora_megatron.comm.protocol import SamplingParams

    model_dir = make_tiny_moe(tmp_path / "moe", seed=3)
    plain = Scheduler(load_model(model_dir), SchedulerLimits(max_running=1))  # speculative off
    out = {}
    plain.submit(Request("ref", PROMPT, SamplingParams(**GREEDY), on_done=lambda r: out.update(r)))
    while plain.can_step():
        plain.step()
    ref = out["output_ids"]

    engine = start_engine(model_dir, max_running=4, extra_args=["--speculative", "group", "--spec-tokens", "4"])
    try:
        async def go():
            async with EngineClient(engine.url) as c:
                assert await c.supports("draft_sources")
                sent = await c.generate(PROMPT, GREEDY, rid="sent", draft_sources=[PROMPT + ref])
                info = await c.server_info()
                assert not await c.add_draft_sources("gone", [PROMPT + ref])  # not running: False
                loads = await c._request("GET", "/v1/loads")
                return sent, info, loads

        sent, info, loads = asyncio.run(go())
    finally:
        engine.stop()
    assert sent.output_ids == ref
    assert info["speculative"] == "group" and info["spec_verify_steps"] > 0
    assert info["spec_accepted_tokens"] >= 0.8 * len(ref) - info["spec_verify_steps"]  # the sibling's drafts held
    assert loads["loads"][0]["spec_verify_steps"] == info["spec_verify_steps"]
