"""The SGLang 0.5.23 stand-in behaves as SGLang 0.5.23's source says (each point cites the file in
``tests/sglang_standin.py``), so the SGLang-path tests cannot pass on behaviour SGLang lacks."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from dora_megatron.data import tokenizer as tok
from dora_megatron.comm.sglang_client import SGLangClient
from tests.sglang_standin import start_standin

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dummy_server(model_dir, tmp_path_factory):
    """A server started with ``--load-format dummy`` (every version pushed by the trainer)."""
    inst = start_standin(model_dir, tmp_path_factory.mktemp("standin"), name="dummy", load_format="dummy")
    yield inst
    inst.stop()


def test_standin_speaks_sglang_0_5_23(dummy_server, model_dir):
    url = dummy_server.url
    prompt = tok.encode("4711:", add_bos=True)

    async def go():
        out = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.post(url + "/abort_request", json={"rid": "nobody#"}) as r:
                out["abort"] = (r.status, await r.read())
            async with http.get(url + "/dora/weights_checksum") as r:
                out["dora"] = r.status
            async with http.post(url + "/flush_cache") as r:
                out["flush"] = (r.status, await r.text())
            async with http.get(url + "/v1/loads") as r:
                out["loads"] = (await r.json())["loads"][0]
            async with http.post(url + "/update_weights_from_disk", json={"model_path": model_dir}) as r:
                out["dummy_update"] = (r.status, await r.json())
        c = SGLangClient(url, timeout_s=60)
        # a pause outlives a disk update: the generate is held until /continue_generation
        await c.pause("abort")
        await c.update_weights_from_disk(model_dir, weight_version=3)  # load_format sent: works on a dummy server
        held = asyncio.create_task(c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 4}))
        done, _ = await asyncio.wait([held], timeout=1.0)
        out["held"] = not done
        await c.continue_generation()
        out["after"] = await asyncio.wait_for(held, timeout=60)
        await c.close()
        return out

    out = asyncio.run(go())
    assert out["abort"] == (200, b"")  # http_server.py: 200 with an empty body, matched or not
    assert out["dora"] == 404
    assert out["flush"][0] == 200 and out["flush"][1].startswith("Cache flushed.")
    load = out["loads"]
    assert load["num_total_tokens"] == load["num_used_tokens"] < load["max_total_num_tokens"]  # nothing waits
    status, body = out["dummy_update"]
    assert status == 400 and body["success"] is False and "dummy" in body["message"]
    assert out["held"], "a paused server served a generate after a disk update"
    assert out["after"].weight_version == "3" and len(out["after"].output_ids) == 4


def test_a_push_loads_the_target_and_leaves_the_eagle_draft_as_loaded(model_dir, tmp_path):
    """dora's pushes name the target runner (``selector: target``): the draft of an EAGLE instance
    keeps its weights, while a push under SGLang's default ``all`` hands it the target's tensors."""
    from dora_megatron.models import hf_model_dir
    from dora_megatron.models.presets import preset_config
    from dora_megatron.ports import free_port
    from dora_megatron.weights.distributed import DistributedWeightPusher

    class AllRunners(SGLangClient):
        weight_selector = "all"  # SGLang's default, which dora does not send

    tensors = sorted(hf_model_dir.random_state_dict(preset_config("tiny-moe"), 5).items())
    inst = start_standin(model_dir, tmp_path, name="eagle", extra_args=(
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(tmp_path / "draft")))

    async def draft_after_push(client: SGLangClient, version: int) -> tuple[str, str]:
        pusher = DistributedWeightPusher({"e": client}, master_address="127.0.0.1", master_port=free_port(),
                                         group_name=f"spec-{version}", backend="gloo", pause_mode="abort",
                                         bucket_mb=64, timeout_s=20)
        await pusher.connect()
        try:
            await pusher.push(version, tensors)
        finally:
            await pusher.disconnect()
        async with aiohttp.ClientSession() as http:
            async with http.post(inst.url + "/weights_checker", json={"action": "checksum"}) as r:
                checksums = (await r.json())["ranks"][0]["checksums"]
        version_now = await client.weight_version()
        await client.close()
        return checksums["draft.model"], version_now

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.post(inst.url + "/weights_checker", json={"action": "checksum"}) as r:
                start = (await r.json())["ranks"][0]["checksums"]["draft.model"]
        return start, await draft_after_push(SGLangClient(inst.url), 1), await draft_after_push(AllRunners(inst.url), 2)

    try:
        start, (ours, v1), (all_runners, v2) = asyncio.run(go())
    finally:
        inst.stop()
    assert (v1, v2) == ("1", "2")  # both pushes reached the target
    assert ours == start  # selector target: the draft runner was not handed the target's tensors
    assert all_runners != start  # the control: under "all" the stand-in's draft does receive them
