"""The SGLang distributed-push choreography, run against any two SGLang-shaped servers: the
0.5.23 stand-ins (``tests/integration/test_sglang_path.py``) and the real servers
(``tests/integration/test_sglang_conformance.py``).

Both runs share one pytest worker process, whose torch keeps every process-group name it ever
created: each pusher here gets a name of its own and is disconnected on every exit path, so a run
that fails halfway (the real-server run is an expected failure) leaves nothing behind for the next.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from dora_megatron.comm.engine_client import VersionMismatch
from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.data import tokenizer as tok
from dora_megatron.models import hf_model_dir
from dora_megatron.ports import free_port
from dora_megatron.rollout.sglang.engine import SGLangEngine
from dora_megatron.weights.distributed import DistributedWeightPusher
from dora_megatron.weights.results import PushError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny MoE whose greedy answers end (EOS) after very different lengths: a long tail."""
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    cfg["initializer_range"] = 0.3
    out = tmp_path_factory.mktemp("sgl-moe")
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, 1))
    return str(out)


def _pusher(clients: dict[str, SGLangClient], pause_mode: str) -> DistributedWeightPusher:
    # 60 s: on a loaded CI machine the instances took over 10 s to join; 1 MiB buckets: several
    return DistributedWeightPusher(clients, {n: 1 for n in clients}, master_address="127.0.0.1",
                                   master_port=free_port(), group_name=f"dora-test-{pause_mode}-{uuid.uuid4().hex[:8]}",
                                   backend="gloo", pause_mode=pause_mode, bucket_mb=1, timeout_s=60)


async def _running(client: SGLangClient, n: int = 1) -> None:
    for _ in range(1000):  # bounded: 10 s
        if (await client.server_info())["num_running_reqs"] == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the long request never ran")


async def _scenario(clients: dict[str, SGLangClient], model_dir: str) -> tuple[Any, Any, dict[str, Any]]:
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    new = hf_model_dir.random_state_dict(cfg, 11)
    newer = hf_model_dir.random_state_dict(cfg, 12)
    prompt = tok.encode("123:", add_bos=True)
    long = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    for c in clients.values():
        await c.update_weights_from_disk(model_dir, weight_version=0)
    before = await clients["e0"].generate(prompt, greedy)
    sum_before = await clients["e0"].instance_checksum()
    out: dict[str, Any] = {"num_new": len(new)}
    # 1. abort pause: the in-flight request comes back cut, every instance takes v7
    pusher = _pusher(clients, "abort")
    try:
        await pusher.connect()
        in_flight = asyncio.create_task(clients["e1"].generate(prompt, long, rid="long-1#"))
        await _running(clients["e1"])
        out["report"] = await pusher.push(7, sorted(new.items()))
        out["cut"] = await in_flight
        out["after"] = {n: (await c.generate(prompt, greedy), await c.instance_checksum(), await c.weight_version())
                        for n, c in clients.items()}
        # a stale routing decision is caught from the echoed version (SGLang has no per-request check)
        with pytest.raises(VersionMismatch):
            await SGLangEngine(clients["e0"]).generate(prompt, greedy, rid="stale", version=6)
    finally:
        await pusher.disconnect()
    # 2. retract pause: the request waits, the cache is flushed, it resumes on v9 and says so
    pusher = _pusher(clients, "retract")
    try:
        await pusher.connect()
        # 1500 tokens: still running when the pause lands, however fast this machine is; cut once
        # it decoded on v9, so a loaded machine does not wait for the rest
        crossing = asyncio.create_task(SGLangEngine(clients["e1"]).generate(
            prompt, {**long, "max_new_tokens": 1500}, rid="cross", version=7))
        await _running(clients["e1"])
        await asyncio.sleep(0.5)  # let it produce tokens on v7 first
        await pusher.push(9, sorted(newer.items()))
        # retracted, it waits; counted running again only after the step that re-admitted it,
        # re-prefilled it and sampled its first token on v9
        await _running(clients["e1"])
        await SGLangEngine(clients["e1"]).abort("cross")
        out["crossed"] = await asyncio.wait_for(crossing, timeout=120)
        # 3. a push failing halfway (the last bucket names a tensor the model lacks): the instance
        # refuses it before receiving, the broadcast fails after the group timeout
        items = sorted(new.items()) + [("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(4, 4))]
        with pytest.raises(PushError) as bad:
            await pusher.push(10, items)
        out["bad"] = bad.value
        out["after_bad"] = {n: await c.weight_version() for n, c in clients.items()}
        # resumed: a generate answers (a still-paused SGLang holds it until its timeout)
        out["served"] = await asyncio.wait_for(clients["e0"].generate(prompt, greedy), timeout=60)
        # the failed push closed its sessions: a new one opens
        for c in clients.values():
            await c.begin_weight_update()
            await c.end_weight_update()
    finally:
        await pusher.disconnect()
    return before, sum_before, out


def check_push_choreography(engines: list[Any], model_dir: str) -> None:
    """pause -> begin_weight_update -> buckets (version on the last) -> end -> continue; a retract
    pause flushes and the request that crossed the update reports both versions; a push that
    fails halfway leaves the instances resumed, their sessions closed and the old version reported.
    ``engines``: at least two running servers (objects with a ``url``)."""

    async def go() -> tuple[Any, Any, dict[str, Any]]:
        clients = {f"e{i}": SGLangClient(e.url) for i, e in enumerate(engines[:2])}
        try:
            return await _scenario(clients, model_dir)
        finally:
            for c in clients.values():
                await c.close()

    before, sum_before, out = asyncio.run(go())
    report, cut, after = out["report"], out["cut"], out["after"]
    assert report.num_buckets > 1 and report.num_tensors == out["num_new"] and set(report.paused) == {"e0", "e1"}
    assert cut.finish_type == "abort" and 0 < len(cut.output_ids) < 400 and cut.weight_version == "0"
    sums = {checksum for _, checksum, _ in after.values()}
    assert len(sums) == 1 and sum_before not in sums  # both hold the same, new weights
    for gen, _, version in after.values():
        assert version == "7" and gen.weight_version == "7" and gen.output_ids != before.output_ids
    crossed = out["crossed"]
    assert crossed.versions_used == ["7", "9"] and crossed.finish_type == "abort", crossed.weight_versions
    assert 0 < len(crossed.output_ids) < 1500
    assert {"e0", "e1"} <= set(out["bad"].errors) and "rejected before receiving" in out["bad"].errors["e0"]
    assert out["after_bad"] == {"e0": "9", "e1": "9"}, "a half-pushed v10 must not be reported"
    assert out["served"].weight_version == "9"
