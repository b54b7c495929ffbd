"""SGLang smoke test on a GPU machine: launch, generate, one weight update, version echo.

Skipped without CUDA or without sglang (in this interpreter, or in the one named by
``DORA_SGLANG_PYTHON``, since SGLang pins its own torch). ``DORA_GPU_MODEL`` may name a small
Hugging Face model directory (e.g. Qwen3-0.6B); by default the tiny MoE preset is created.
With two or more GPUs the update goes through ``/init_weights_update_group`` +
``/update_weights_from_distributed`` over NCCL (trainer side in this process on the last GPU);
with one GPU it goes through ``/update_weights_from_disk``. Run with ``bash tools/gpu_smoke.sh``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess

import pytest

pytestmark = pytest.mark.gpu


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def _sglang_python() -> str | None:
    py = os.environ.get("DORA_SGLANG_PYTHON")
    if py:
        ok = subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode == 0
        return py if ok else None
    import sys

    return sys.executable if importlib.util.find_spec("sglang") is not None else None


GPUS = _cuda_count()
SGL_PY = _sglang_python() if GPUS else None
if not GPUS or not SGL_PY:
    pytest.skip("needs CUDA and sglang (set DORA_SGLANG_PYTHON to an interpreter with sglang)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if os.environ.get("DORA_GPU_MODEL"):
        return os.environ["DORA_GPU_MODEL"]
    from dora_megatron.models.presets import create_model_dir

    return str(create_model_dir("tiny-moe", tmp_path_factory.mktemp("gpu-moe"), seed=0))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.processes import ProcessSet
    from dora_megatron.launch.plan import ProcessSpec
    from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv
    from dora_megatron.rollout.sglang.server import start_instance, wait_ready

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", f"sglang.python={SGL_PY}",
                             "sglang.mem_fraction_static=0.3", "rollout.max_running=8"])
    port = _free_port()
    spec = InstanceSpec("sgl-smoke", model_dir, "127.0.0.1", port, _free_port(), 0, 1, "0", seed=0)
    logs = tmp_path_factory.mktemp("sgl-logs")
    with ProcessSet(logs, grace_s=30) as procs:
        child = start_instance(procs, ProcessSpec("engine", "sgl-smoke", "127.0.0.1", server_argv(spec, cfg.sglang, cfg.rollout)))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url, timeout_s=900, alive=child.alive, tail=child.tail))
        yield url, cfg


def test_generate_update_and_version_echo(server, model_dir):
    import torch

    from dora_megatron.models import hf_io
    from dora_megatron.rollout.sglang.client import SGLangClient
    from dora_megatron.rollout.sglang.engine import SGLangEngine
    from dora_megatron.weights.distributed import DistributedWeightPusher

    url, cfg = server
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

    async def go():
        client = SGLangClient(url, timeout_s=600)
        engine = SGLangEngine(client)
        first = await engine.generate(prompt, greedy, rid="smoke.1", version=0)
        assert len(first.output_ids) == 8 and first.weight_version == "0"
        assert not await engine.supports("export_request")  # SGLang: no dora extensions
        info = await engine.server_info()
        assert "num_running_reqs" in info
        if GPUS >= 2:
            state = hf_io.load_state_dict(model_dir)
            device = torch.device("cuda", GPUS - 1)
            torch.cuda.set_device(device)  # the trainer side's NCCL rank must not share SGLang's GPU 0
            tensors = [(n, t.to(device=device, dtype=torch.bfloat16)) for n, t in sorted(state.items())]
            pusher = DistributedWeightPusher({"sgl": client}, {"sgl": 1}, master_address="127.0.0.1",
                                             master_port=_free_port(), group_name="dora-smoke", backend="nccl",
                                             pause_mode="abort", bucket_mb=64)
            await pusher.connect()
            report = await pusher.push(1, tensors)
            assert report.num_tensors == len(tensors)
            await pusher.disconnect()
        else:
            await client.update_weights_from_disk(model_dir, weight_version=1)
        second = await engine.generate(prompt, greedy, rid="smoke.2", version=1)
        assert second.weight_version == "1" and await engine.weight_version() == "1"
        assert second.output_ids == first.output_ids  # the same weights were pushed back
        await client.close()

    asyncio.run(go())
