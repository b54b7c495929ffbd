"""The SGLang production path on a GPU machine with a real SGLang 0.5.23 server.

What the CPU tests prove against the stand-in (``tests/sglang_standin.py``), checked here against
the real server: ``/v1/loads`` numbers and version, ``/model_info``, the empty abort reply and an
abort racing the dispatch (retried until the generate returns), the plain-text flush, the
weight-update session rule, a pause that outlives a disk update, and with two or more GPUs the
whole distributed choreography over NCCL (pause, begin, buckets with the version on the last, end,
continue), a ``retract`` push crossed by a running request (``meta_info.weight_versions``), and a
push that fails halfway (instance resumed, old version reported, session closed).

Skipped without CUDA or without a *usable* SGLang: an interpreter in which
``sglang.srt.entrypoints.http_server`` imports (this one, or ``DORA_SGLANG_PYTHON``, since SGLang
pins its own torch); a wheel that is only unpacked (``tools/setup_env.sh`` does that for the CPU
tests) does not count. ``DORA_GPU_MODEL`` may name a small Hugging Face model directory (e.g.
Qwen3-0.6B); by default the tiny MoE preset is created. Run with ``bash tools/gpu_smoke.sh``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

#: importing this module pulls SGLang's whole server stack: proof of a usable install
USABLE_PROBE = "import sglang.srt.entrypoints.http_server, sglang; print(sglang.__version__)"


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _sglang_python() -> str | None:
    py = os.environ.get("DORA_SGLANG_PYTHON") or sys.executable
    try:
        ok = subprocess.run([py, "-c", USABLE_PROBE], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return py if ok else None


GPUS = _cuda_count()
SGL_PY = _sglang_python() if GPUS else None
if not GPUS or not SGL_PY:
    pytest.skip("needs CUDA and a usable sglang (set DORA_SGLANG_PYTHON to an interpreter with sglang 0.5.23)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if os.environ.get("DORA_GPU_MODEL"):
        return os.environ["DORA_GPU_MODEL"]
    from dora_megatron.models.presets import create_model_dir

    return str(create_model_dir("tiny-moe", tmp_path_factory.mktemp("gpu-moe"), seed=0))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from dora_megatron.config.schema import load_config
    from dora_megatron.processes import ProcessSpec
    from dora_megatron.processes import ProcessSet
    from dora_megatron.ports import free_port
    from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv
    from dora_megatron.rollout.sglang.server import start_instance, wait_ready

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", f"sglang.python={SGL_PY}",
                             "sglang.mem_fraction_static=0.3", "rollout.max_running=8"])
    port = free_port()
    spec = InstanceSpec("sgl-smoke", model_dir, "127.0.0.1", port, free_port(), 0, 1, "0", seed=0)
    logs = tmp_path_factory.mktemp("sgl-logs")
    with ProcessSet(logs, grace_s=30) as procs:
        child = start_instance(procs, ProcessSpec("engine", "sgl-smoke", "127.0.0.1", server_argv(spec, cfg.sglang, cfg.rollout)), "sglang")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url, path="/health_generate", timeout_s=900, alive=child.alive, tail=child.tail))
        yield url


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 2000, "ignore_eos": True}


def test_loads_version_flush_abort_and_session_rule(server, model_dir):
    import aiohttp

    from dora_megatron.controller.migration import abort_until_returned
    from dora_megatron.comm.engine_client import EngineError
    from dora_megatron.comm.sglang_client import SGLangClient
    from dora_megatron.rollout.sglang.engine import SGLangEngine
    from dora_megatron.rollout.sglang.server import check_versions

    async def go():
        client = SGLangClient(server, timeout_s=600)
        engine = SGLangEngine(client)
        assert await check_versions([server]) == []  # the tested release
        idle = await client.server_info()
        assert idle["num_running_reqs"] == 0 and 0.0 <= idle["kv_usage"] < 0.5, idle  # not ~1.0 (item 3)
        first = await engine.generate(PROMPT, GREEDY, rid="smoke.1", version=0)
        assert len(first.output_ids) == 8 and first.versions_used == ["0"]
        assert not await engine.supports("export_request")
        assert await client.flush_cache()  # plain-text reply
        async with aiohttp.ClientSession() as http:
            async with http.post(server + "/abort_request", json={"rid": "nobody#"}) as r:
                assert r.status == 200 and await r.read() == b""
        # an abort racing the dispatch: retried until the generate returns, cut short
        racing = asyncio.create_task(engine.generate(PROMPT, LONG, rid="race"))
        await abort_until_returned(engine, "race", racing)
        cut = await racing
        assert cut.finish_type == "abort" and len(cut.output_ids) < 2000
        # the session rule (weight_updater.py)
        with pytest.raises(EngineError, match="begin_weight_update"):
            await client.update_weights_from_distributed(["model.embed_tokens.weight"], ["bfloat16"], [[1, 1]])
        await client.begin_weight_update()
        with pytest.raises(EngineError, match="already open"):
            await client.begin_weight_update()
        await client.end_weight_update()
        # a pause outlives a disk update: the generate waits for /continue_generation
        checksum = await client.instance_checksum()
        await client.pause("abort")
        await client.update_weights_from_disk(model_dir, weight_version=1)
        held = asyncio.create_task(engine.generate(PROMPT, GREEDY, rid="smoke.2", version=1))
        done, _ = await asyncio.wait([held], timeout=3.0)
        assert not done, "a paused SGLang served a generate"
        await client.continue_generation()
        second = await asyncio.wait_for(held, timeout=120)
        assert second.weight_version == "1" and second.output_ids == first.output_ids  # same weights
        assert await client.instance_checksum() == checksum
        await client.close()

    asyncio.run(go())


@pytest.mark.skipif(GPUS < 2, reason="the trainer side of the NCCL group needs its own GPU")
def test_distributed_choreography_over_nccl(server, model_dir):
    import torch

    from dora_megatron.models import hf_model_dir
    from dora_megatron.ports import free_port
    from dora_megatron.comm.sglang_client import SGLangClient
    from dora_megatron.rollout.sglang.engine import SGLangEngine
    from dora_megatron.weights.distributed import DistributedWeightPusher
    from dora_megatron.weights.results import PushError

    state = hf_model_dir.load_state_dict(model_dir)
    device = torch.device("cuda", GPUS - 1)
    torch.cuda.set_device(device)  # the trainer's NCCL rank must not share SGLang's GPU 0
    tensors = [(n, t.to(device=device, dtype=torch.bfloat16)) for n, t in sorted(state.items())]

    async def go():
        client = SGLangClient(server, timeout_s=600)
        engine = SGLangEngine(client)
        before = await engine.generate(PROMPT, GREEDY, rid="nccl.0")
        pusher = DistributedWeightPusher({"sgl": client}, {"sgl": 1}, master_address="127.0.0.1",
                                         master_port=free_port(), group_name="dora-smoke", backend="nccl",
                                         pause_mode="retract", bucket_mb=8, timeout_s=120)
        await pusher.connect()
        try:
            crossing = asyncio.create_task(engine.generate(PROMPT, LONG, rid="cross", version=before.weight_version))
            await asyncio.sleep(1.0)  # it runs and makes tokens on the old version
            report = await pusher.push(5, tensors)  # the same weights, a new version label
            assert report.num_buckets >= 1 and report.versions == {"sgl": "5"}
            crossed = await crossing
            assert crossed.versions_used == [before.weight_version, "5"], crossed.weight_versions
            after = await engine.generate(PROMPT, GREEDY, rid="nccl.1", version=5)
            assert after.output_ids == before.output_ids
            # a push that fails halfway: the last bucket names a tensor the model lacks
            bad = tensors + [("model.layers.0.mlp.experts.999.up_proj.weight", torch.zeros(4, 4, device=device,
                                                                                          dtype=torch.bfloat16))]
            with pytest.raises(PushError):
                await pusher.push(6, bad)
            assert await client.weight_version() == "5"  # the half-pushed version is not reported
            served = await asyncio.wait_for(engine.generate(PROMPT, GREEDY, rid="nccl.2"), timeout=120)
            assert served.weight_version == "5"  # resumed
            await client.begin_weight_update()  # the failed push closed its session
            await client.end_weight_update()
        finally:
            await pusher.disconnect()
            await client.close()

    asyncio.run(go())
