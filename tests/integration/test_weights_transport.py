"""Weight transports against real engine processes: bucketed distributed push (gloo), disk, the
trainer service's ``/push_weights``, and failures (rejected bucket, sender dying)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from dora_megatron.models import hf_model_dir
from dora_megatron.models.presets import preset_config
from dora_megatron.comm.engine_client import EngineClient, EngineError
from dora_megatron.comm.checksum import weights_checksum
from dora_megatron.ports import free_port
from dora_megatron.weights.transport import PushError, push_disk, push_distributed
from tests.helpers.engine_logits import full_logits

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [10, 11, 12, 13, 50, 51] * 2
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _model(root, seed: int) -> str:
    cfg = preset_config("tiny-moe")
    cfg["num_hidden_layers"] = 2
    cfg["initializer_range"] = 0.1
    out = root / f"moe-{seed}"
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, seed))
    return str(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return [_model(root, s) for s in range(4)]


@pytest.fixture(scope="module")
def engines(dirs):
    from dora_megatron.rollout.engine.process import start_engine

    eps = []
    try:
        for _ in range(2):
            eps.append(start_engine(dirs[0], max_running=2, num_threads=1, weight_version="0"))
        yield [e.url for e in eps]
    finally:
        for e in eps:
            e.stop()


async def _state(url: str):
    async with EngineClient(url, timeout_s=60) as c:  # a hung engine fails the test instead of stalling it
        r = await c.generate(PROMPT, GREEDY)
        return {"ids": r.output_ids, "lps": r.output_token_logprobs, "version": await c.weight_version(),
                "checksum": await c.weights_checksum()}


def state(url: str) -> dict:
    return asyncio.run(_state(url))


def _reference(model_dir: str, output_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Log-probs of ``output_ids`` and the greedy choices under the weights of ``model_dir``."""
    from dora_megatron.rollout.engine.model import load_model

    logits = full_logits(load_model(model_dir), PROMPT + output_ids)
    logp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(output_ids) - 1)
    return logp[pos, torch.tensor(output_ids)], logp[pos].argmax(dim=-1).tolist()


def test_distributed_push_to_two_engines_in_buckets(engines, dirs):
    new = hf_model_dir.load_state_dict(dirs[1])
    before = state(engines[0])
    result = push_distributed(new, engines, bucket_mb=0.25, version=1, timeout_s=60)
    assert result.num_buckets > 3 and result.num_tensors == len(new)
    assert result.bytes == sum(t.numel() * t.element_size() for t in new.values())
    assert result.checksum == weights_checksum(new)
    assert result.versions == {u: "1" for u in engines}
    after = [state(u) for u in engines]
    for s in after:
        assert s["version"] == "1" and s["checksum"] == result.checksum
    assert after[0]["lps"] != before["lps"]
    # the new logits are those of the pushed weights
    ref_lps, ref_greedy = _reference(dirs[1], after[0]["ids"])
    assert torch.allclose(torch.tensor(after[0]["lps"]), ref_lps, atol=1e-4)
    assert after[0]["ids"] == ref_greedy


def test_push_from_a_torchrun_child_hosts_its_own_rendezvous(engines, dirs, monkeypatch):
    """Under torchrun ``TORCHELASTIC_USE_AGENT_STORE=True``; torch's tcp:// rendezvous would then
    make rank 0 a client of the agent's store and the group would never form."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    port = free_port()  # fixed, as cluster.weight_group_port on SLURM: pushed to twice in a row
    for version in (8, 9):
        result = push_distributed(hf_model_dir.load_state_dict(dirs[0]), engines[:1], bucket_mb=64, version=version,
                                  timeout_s=30, master_port=port)
        assert result.versions == {engines[0]: str(version)} and state(engines[0])["checksum"] == result.checksum


def test_rejected_bucket_keeps_old_version(engines, dirs):
    good = state(engines[0])
    bad = dict(hf_model_dir.load_state_dict(dirs[2]))
    bad["model.norm.weight"] = torch.ones(5)  # wrong shape in the metadata
    t0 = time.monotonic()
    with pytest.raises(PushError) as err:
        push_distributed(bad, engines[:1], bucket_mb=64, version=2, timeout_s=5)
    assert time.monotonic() - t0 < 60  # bounded by timeout_s, no hang
    assert "model.norm.weight" in str(err.value) and "old weights kept" in str(err.value)
    assert state(engines[0]) == good
    # the engine is usable for the next push (new group)
    ok = push_distributed(hf_model_dir.load_state_dict(dirs[2]), engines[:1], bucket_mb=64, version=2, timeout_s=60)
    assert ok.versions == {engines[0]: "2"} and state(engines[0])["checksum"] == ok.checksum


SENDER_DIES = r"""
import json, sys, threading, urllib.request, os, torch
from dora_megatron.comm import weight_group
url, port = sys.argv[1], int(sys.argv[2])
def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except Exception:
        pass
t = threading.Thread(target=post, args=("/init_weights_update_group", {"master_address": "127.0.0.1",
    "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "dying", "backend": "gloo"}))
t.start()
g = weight_group.init_weight_update_group("127.0.0.1", port, 0, 2, "dying", "gloo", 60)
t.join()
names = ["model.norm.weight", "model.embed_tokens.weight"]
body = {"names": names, "dtypes": ["float32", "float32"], "shapes": [[128], [%d, 128]], "group_name": "dying",
        "weight_version": "99"}
threading.Thread(target=post, args=("/update_weights_from_distributed", body), daemon=True).start()
weight_group.send_tensors(g, [torch.zeros(128)])  # first tensor only, then die mid-bucket
print("sent one", flush=True)
os._exit(0)
"""


def test_sender_dying_mid_bucket_keeps_old_version(engines):
    good = state(engines[1])
    vocab = preset_config("tiny-moe")["vocab_size"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SENDER_DIES % vocab, engines[1], str(free_port())], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "sent one" in proc.stdout, proc.stderr[-2000:]

    async def groups():
        async with EngineClient(engines[1], timeout_s=60) as c:
            return (await c.server_info())["weight_update_groups"]

    assert "dying" in asyncio.run(groups())  # the engine did join the sender's group
    # the engine noticed the dead peer (connection closed), answered, and kept its weights and version
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = state(engines[1])
        if s == good:
            break
        time.sleep(0.5)
    assert s == good


def test_disk_copy(engines, dirs, tmp_path):
    from dora_megatron.weights.snapshots import SnapshotStore

    store = SnapshotStore(tmp_path / "weights")
    tensors = hf_model_dir.load_state_dict(dirs[3])
    checksum = store.write(3, tensors, dirs[3])
    res = asyncio.run(push_disk(str(store.path(3)), engines[:1], 3))
    assert res.versions == {engines[0]: "3"} and res.checksum == checksum
    assert state(engines[0])["checksum"] == checksum
    assert state(engines[1])["version"] != "3"


class _FakeMegatron:
    """Stands in for TrainerWorker: its export yields the weights of an HF directory."""

    def __init__(self, model_dir: str) -> None:
        self.weights = hf_model_dir.load_state_dict(model_dir)

    def export_hf_state_dict(self):
        return iter(self.weights.items())


def test_trainer_service_push_weights(engines, dirs):
    from dora_megatron.controller.trainer_client import TrainerClient, TrainerError
    from dora_megatron.trainer.service import VersionedWorker
    from dora_megatron.trainer.service import Command, TrainerService

    worker = VersionedWorker(_FakeMegatron(dirs[1]), dirs[1], rank=0)
    worker.version = 5
    service = TrainerService(worker, run_dir=REPO, rank=0, world_size=1)
    port = free_port()
    thread = threading.Thread(target=service.leader_loop, args=("127.0.0.1", port), daemon=True)
    thread.start()

    async def go():
        client = TrainerClient(f"http://127.0.0.1:{port}")
        try:
            while await client.health() is None:
                await asyncio.sleep(0.05)
            with pytest.raises(TrainerError, match="engines"):
                await client.push_weights([], 16)
            with pytest.raises(TrainerError, match="nccl needs a trainer on CUDA"):
                await client.push_weights(engines, 0.5, backend="nccl")  # this trainer runs on CPU
            return await client.push_weights(engines, 0.5, pause_mode="abort")  # paused, pushed, continued
        finally:
            await client.shutdown()
            await client.close()

    reply = asyncio.run(go())
    thread.join(timeout=30)
    expected = weights_checksum(worker.worker.weights)
    assert reply["checksum"] == expected and reply["version"] == 5 and reply["num_buckets"] > 1
    assert reply["versions"] == {u: "5" for u in engines}
    assert all(state(u)["checksum"] == expected for u in engines)
    assert Command  # the service module's command type is what the route feeds
