"""Weight updates of a running engine: from disk and over a torch.distributed (gloo) group."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dora_megatron.models import hf_model_dir
from dora_megatron.models.presets import create_model_dir, preset_config
from dora_megatron.ports import free_port
from dora_megatron.comm.engine_client import EngineClient, EngineError
from dora_megatron.comm import weight_group
from dora_megatron.comm.checksum import weights_checksum

pytestmark = pytest.mark.integration

PROMPT = [10, 11, 12, 13, 50, 51] * 3
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def _model(tmp_path_factory, preset, seed):
    out = tmp_path_factory.mktemp(f"{preset}-{seed}")
    cfg = preset_config(preset)
    cfg["initializer_range"] = 0.1
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, seed))
    return str(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {s: _model(tmp_path_factory, "tiny-moe", s) for s in (0, 1, 2)} | {
        "dense": str(create_model_dir("tiny-dense", tmp_path_factory.mktemp("dense"), 0))
    }


@pytest.fixture(scope="module")
def engine(dirs):
    from dora_megatron.rollout.engine.process import start_engine

    ep = start_engine(dirs[0], max_running=4, num_threads=1, weight_version="0")
    yield ep
    ep.stop()


async def _state(c: EngineClient):
    r = await c.generate(PROMPT, GREEDY)
    return r.output_ids, r.weight_version, await c.weights_checksum(), await c.weight_version()


def test_update_from_disk_changes_outputs_version_and_checksum(engine, dirs):
    async def go():
        async with EngineClient(engine.url) as c:
            before = await _state(c)
            await c.update_weights_from_disk(dirs[1], weight_version=1)
            after = await _state(c)
            with pytest.raises(EngineError) as bad:
                await c.update_weights_from_disk(dirs["dense"], weight_version=99)
            with pytest.raises(EngineError) as missing:
                await c.update_weights_from_disk("/nonexistent/dir", weight_version=99)
            kept = await _state(c)
            return before, after, bad.value, missing.value, kept

    before, after, bad, missing, kept = asyncio.run(go())
    assert before[1] == "0" and before[2] == weights_checksum(hf_model_dir.load_state_dict(dirs[0]))
    assert after[0] != before[0]
    assert after[1] == after[3] == "1"
    assert after[2] == weights_checksum(hf_model_dir.load_state_dict(dirs[1]))
    assert bad.status == 400 and "mlp.gate_proj" in bad.message and "old weights kept" in bad.message
    assert missing.status == 400 and "/nonexistent/dir" in missing.message
    assert kept == after  # failed updates left weights and version intact


def test_update_over_distributed_group(engine, dirs):
    new = hf_model_dir.load_state_dict(dirs[2])
    names = sorted(new)
    half = len(names) // 2
    buckets = [names[:half], names[half:]]

    async def go():
        async with EngineClient(engine.url) as c:
            before = await _state(c)
            port = free_port()
            group_box = {}

            def trainer_join():
                # 15 s bounds the trainer's broadcast of the rejected bucket below (it may never be received)
                group_box["g"] = weight_group.init_weight_update_group("127.0.0.1", port, 0, 2, "wg-test", "gloo", 15)

            await asyncio.gather(
                c.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wg-test", backend="gloo"),
                asyncio.to_thread(trainer_join),
            )
            g = group_box["g"]
            for bucket in buckets:  # two buckets, like a bucketed trainer export
                tensors = [new[n] for n in bucket]
                await asyncio.gather(
                    c.update_weights_from_distributed(
                        bucket, [t.dtype for t in tensors], [t.shape for t in tensors], group_name="wg-test", weight_version=5
                    ),
                    asyncio.to_thread(weight_group.send_tensors, g, tensors),
                )
            after = await _state(c)
            # wrong name and wrong shape: rejected before receiving (nothing allocated, old weights
            # kept); the trainer's side of that broadcast fails after its group timeout at the latest
            bad_names = ["model.norm.weight", "model.layers.0.mlp.experts.99.up_proj.weight", "lm_head.weight"]
            bad_tensors = [torch.zeros(128), torch.zeros(128, 128), torch.zeros(5, 5)]
            results = await asyncio.gather(
                c.update_weights_from_distributed(
                    bad_names, ["float32"] * 3, [list(t.shape) for t in bad_tensors], group_name="wg-test", weight_version=6
                ),
                asyncio.to_thread(weight_group.send_tensors, g, bad_tensors),
                return_exceptions=True,
            )
            kept = await _state(c)
            still = await c.generate(PROMPT, GREEDY)
            await c.destroy_weights_update_group("wg-test")
            weight_group.destroy_weight_update_group(g)
            return before, after, results[0], kept, still

    before, after, err, kept, still = asyncio.run(go())
    assert after[0] != before[0] and after[1] == after[3] == "5"
    assert after[2] == weights_checksum(new)  # engine checksum equals the trainer-side checksum
    assert isinstance(err, EngineError) and err.status == 400
    assert "experts.99" in err.message and "lm_head.weight" in err.message
    assert kept == after and len(still.output_ids) == 16


def test_update_waits_for_running_requests_and_holds_new_ones(engine, dirs):
    """SGLang semantics when not paused: the update drains in-flight work first."""

    async def go():
        async with EngineClient(engine.url) as c:
            v0 = await c.weight_version()
            long = asyncio.create_task(c.generate(PROMPT, {**GREEDY, "max_new_tokens": 400}))
            for _ in range(500):
                if (await c.server_info())["num_running_reqs"] == 1:
                    break
                await asyncio.sleep(0.01)
            update = asyncio.create_task(c.update_weights_from_disk(dirs[0], weight_version=int(v0) + 10))
            for _ in range(500):
                if (await c.server_info())["weight_update_pending"]:
                    break
                await asyncio.sleep(0.01)
            late = asyncio.create_task(c.generate(PROMPT, GREEDY))
            return v0, await long, await update, await late

    v0, long_res, _, late_res = asyncio.run(go())
    # the running request finished on the old weights (version echoed at its end), the late one on the new
    assert long_res.weight_version == v0 and len(long_res.output_ids) == 400
    assert late_res.weight_version == str(int(v0) + 10)
