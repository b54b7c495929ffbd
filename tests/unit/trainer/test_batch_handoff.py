"""``/train`` with a batch directory: the client writes it off the loop, each data-parallel rank
of the service reads only the rows its plan trains, a bad directory is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import base64
import contextlib
import socket
import threading
from array import array
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from dora_megatron.comm.train_sample import TrainRequest, TrainSample, decode_train
from dora_megatron.controller.trainer_client import TrainerClient, TrainerError
from dora_megatron.trainer.packing import plan_step
from dora_megatron.trainer.service import BadRequest, Command, TrainerService


class ShardWorker:
    """One DP rank of ``dp``: plans by the lengths like the real worker, records what it trained on."""

    def __init__(self, dp: int, dp_rank: int) -> None:
        self.version, self.dp, self.dp_rank = 0, dp, dp_rank
        self.trained: list = []

    def data_rows(self, lengths):
        plan = plan_step(list(lengths), dp=self.dp, dp_rank=self.dp_rank, micro_batch_size=2, max_tokens=0)
        return sorted({i for mb in plan.micro_batches for i in mb.rows if i >= 0})

    def train_step(self, samples):
        self.trained = samples
        self.version += 1
        return {"loss": 0.0}

    def export_snapshot(self, out_dir: Path):
        return None


def _samples(n: int) -> list[TrainSample]:
    return [TrainSample([1, 2, 3], array("i", range(10, 10 + 2 + i)), array("f", [-0.25] * (2 + i)), version=0,
                        reward=float(i % 2), group_id=f"g{i // 2}") for i in range(n)]


def _serve(svc: TrainerService) -> tuple[int, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = threading.Thread(target=svc.leader_loop, args=("127.0.0.1", port), daemon=True)
    t.start()
    return port, t


@contextlib.asynccontextmanager
async def _client(port: int, **kwargs: Any) -> AsyncIterator[TrainerClient]:
    """A client of the service on ``port`` once it answers ``/health`` (the leader loop starts in
    a thread); the service is shut down and the client closed on the way out."""
    client = TrainerClient(f"http://127.0.0.1:{port}", **kwargs)
    while await client.health() is None:
        await asyncio.sleep(0.02)
    try:
        yield client
    finally:
        await client.shutdown()
        await client.close()


def test_client_writes_a_batch_each_rank_trains_its_own_rows(tmp_path):
    samples = _samples(7)
    leader = ShardWorker(dp=2, dp_rank=0)
    svc = TrainerService(leader, run_dir=tmp_path, rank=0, world_size=2)
    port, thread = _serve(svc)
    sent: dict = {}

    async def go():
        async with _client(port, batch_dir=tmp_path / "batches") as c:
            original = c._post

            async def spy(path, body):
                # what the other rank gets broadcast: the entry, no token (encoded off the loop)
                sent.update(json.loads(body) if isinstance(body, bytes) else body)
                return await original(path, body)

            c._post = spy
            return await c.train(0, samples)

    reply = asyncio.run(go())
    thread.join(timeout=10)
    assert "samples" not in sent and len(sent["batch"]["samples"]) == 7
    assert not (tmp_path / "batches" / "step_000000").exists()  # gone once the trainer answered
    rows0 = leader.data_rows([3 + 2 + i for i in range(7)])
    assert 0 < len(rows0) < 7
    assert reply["batch_bytes_read"] == sum(4 * 3 + 8 * (2 + i) for i in rows0)
    assert [s.response_ids.tolist() for s in leader.trained if s.response_ids.flags.owndata] == \
        [list(samples[i].response_ids) for i in rows0]


def test_other_rank_reads_the_complement(tmp_path):
    """Rank 1 executes the command rank 0 decoded, received pickled (``broadcast_object_list``)."""
    import pickle

    from dora_megatron.comm.batch_files import write_batch

    samples = _samples(7)
    entry = write_batch(tmp_path / "b", samples)
    cmd = Command("train", decode_train({"step": 0, "batch": entry}))
    out = {}
    for rank in (0, 1):
        w = ShardWorker(dp=2, dp_rank=rank)
        svc = TrainerService(w, run_dir=tmp_path, rank=rank, world_size=2)
        out[rank] = svc.execute(cmd if rank == 0 else pickle.loads(pickle.dumps(cmd)))["batch_bytes_read"]
    total = sum(4 * 3 + 8 * (2 + i) for i in range(7))
    assert out[0] + out[1] == total and out[0] and out[1]


def test_bad_batch_directory_is_a_400_naming_it(tmp_path):
    svc = TrainerService(ShardWorker(1, 0), run_dir=tmp_path, rank=0, world_size=1)
    with pytest.raises(BadRequest, match="batch.dir"):
        svc.execute(Command("train", decode_train({"step": 0, "batch": {
            "dir": str(tmp_path / "nope"), "samples": [{"prompt_tokens": 1, "response_tokens": 1, "reward": 0.0,
                                                         "group_id": "g"}]}})))
    with pytest.raises(BadRequest, match=r"command 'train' takes a TrainRequest body, got dict"):
        svc.execute(Command("train", {"step": 0}))
    with pytest.raises(BadRequest, match="'samples' must be a non-empty list"):  # neither samples nor batch
        svc.execute(Command("train", TrainRequest(0)))
    port, thread = _serve(svc)

    async def go():
        async with _client(port) as c:
            with pytest.raises(TrainerError, match=r"400.*batch\.samples\[0\]\.response_tokens"):
                await c._post("/train", {"step": 0, "batch": {"dir": str(tmp_path), "samples": [{"prompt_tokens": 1}]}})

    asyncio.run(go())
    thread.join(timeout=10)


def test_samples_in_the_body_reach_the_worker_as_the_same_typed_record(tmp_path):
    """Without a batch directory the samples travel in the ``/train`` body: the controller's compact
    arrays go out as lists (routed experts as SGLang's text) and every rank gets
    :class:`TrainSample` records with the same fields; a malformed sample is a 400 naming it."""
    import numpy as np

    samples = _samples(3)
    samples[1].loss_mask = [1, 0, 1]
    samples[2].routed_experts = np.array([3, -1, 7], np.int8)
    worker = ShardWorker(dp=1, dp_rank=0)
    svc = TrainerService(worker, run_dir=tmp_path, rank=0, world_size=1)
    port, thread = _serve(svc)

    async def go():
        async with _client(port) as c:
            bad = TrainSample([1], [2, 3], [0.0], version=1, reward=1.0, group_id="g")
            with pytest.raises(TrainerError, match=r"400.*samples\[0\]: rollout_logprobs \(1\) and response_ids \(2\)"):
                await c.train(0, [bad])
            return await c.train(0, samples)

    reply = asyncio.run(go())
    thread.join(timeout=10)
    assert reply["version"] == 1 and reply["batch_bytes_read"] == 0  # nothing read from files
    got = worker.trained
    assert all(isinstance(s, TrainSample) for s in got) and len(got) == 3
    for s, g in zip(samples, got):
        assert (g.prompt_ids, g.response_ids) == (list(s.prompt_ids), list(s.response_ids))
        assert g.rollout_logprobs == list(s.rollout_logprobs)
        assert (g.version, g.reward, g.group_id, g.loss_mask) == (s.version, s.reward, s.group_id, s.loss_mask)
    assert got[0].routed_experts is None
    assert np.frombuffer(base64.b64decode(got[2].routed_experts), "<i4").tolist() == [3, -1, 7]


def test_spooled_routed_experts_reach_the_rank_that_trains_them_and_trained_segments_go(tmp_path):
    import numpy as np

    from dora_megatron.comm.routed_spool import SPOOL_DIR

    samples = _samples(7)
    want = [np.random.default_rng(i).integers(-1, 100, (3 + 2 + i - 1) * 4).astype(np.int8) for i in range(7)]
    leader = ShardWorker(dp=2, dp_rank=0)
    svc = TrainerService(leader, run_dir=tmp_path, rank=0, world_size=2)
    port, thread = _serve(svc)
    spool_dir = tmp_path / "batches" / SPOOL_DIR

    async def go():
        async with _client(port, batch_dir=tmp_path / "batches") as c:
            c.routed_spool.segment_bytes = 40  # several segment files
            for s, r in zip(samples, want):  # as the sample store queues them when each sample finishes
                s.routed_experts = c.routed_spool.put(r)
            reply = await c.train(0, samples)
            c.routed_spool.flush()  # the deletions are queued behind the spool's writes
            return reply, sorted(p.name for p in spool_dir.iterdir())

    reply, left = asyncio.run(go())
    thread.join(timeout=10)
    rows0 = leader.data_rows([3 + 2 + i for i in range(7)])
    assert 0 < len(rows0) < 7
    trained = {i: s for i, s in enumerate(leader.trained) if s.response_ids.flags.owndata}
    assert sorted(trained) == rows0
    for i in rows0:
        assert trained[i].routed_experts.tolist() == want[i].tolist()
    assert reply["batch_bytes_read"] == sum(4 * 3 + 8 * (2 + i) + want[i].nbytes for i in rows0)
    assert left == [samples[-1].routed_experts.file]  # trained: only the segment still open stays
    assert not spool_dir.exists()  # the client's close removed the spool


_AS_MAIN = '''
import contextlib, importlib.util, io, pickle, sys, types
mode = sys.argv[1]
spec = importlib.util.find_spec("dora_megatron.trainer.service")
main = types.ModuleType("__main__")
main.__file__ = spec.origin
sys.modules["__main__"] = main  # as torchrun runs the module on every rank
sys.argv = ["service", "--help"]  # defines everything, then argparse exits before a rank starts
with contextlib.redirect_stdout(io.StringIO()):
    try:
        exec(compile(open(spec.origin).read(), spec.origin, "exec"), main.__dict__)
    except SystemExit:
        pass
from dora_megatron.comm.train_sample import decode_train
if mode == "send":
    sys.stdout.buffer.write(pickle.dumps([
        main.Command("push_weights", main.validate_push({"engines": ["http://e"], "bucket_mb": 2})),
        main.Command("save_checkpoint", main.validate_checkpoint({"path": "/run/c"})),
        main.Command("train", decode_train({"step": 0, "batch": {"dir": "/run/b", "samples": [
            {"prompt_tokens": 1, "response_tokens": 2, "reward": 1.0, "group_id": "g"}]}}))]))
else:
    push, save, train = pickle.loads(sys.stdin.buffer.read())
    class Worker:
        version = 0
        def push_weights(self, *args):
            return {"args": list(args)}
        def save_checkpoint(self, path):
            pass
    svc = main.TrainerService(Worker(), "/run", rank=1, world_size=2)
    print(repr([svc.execute(push), svc.execute(save), train.body.batch.lengths(), type(push.body).__module__]))
'''


def test_a_command_rank_0_pickles_runs_on_another_rank_when_the_module_is_main(tmp_path):
    """Under torchrun ``service.py`` is ``__main__`` on every rank: a typed command rank 0 pickles
    (``broadcast_object_list``) names ``__main__.PushBody`` and so on, which the other rank's
    ``__main__`` (the same module) resolves; the command runs there with the same fields."""
    import os
    import subprocess
    import sys

    script = tmp_path / "as_main.py"
    script.write_text(_AS_MAIN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    sent = subprocess.run([sys.executable, str(script), "send"], capture_output=True, env=env, timeout=120, check=True)
    got = subprocess.run([sys.executable, str(script), "recv"], input=sent.stdout, capture_output=True, env=env,
                         timeout=120, check=True)
    assert got.stdout.decode().strip() == repr([
        {"args": [["http://e"], 2.0, "127.0.0.1", 120.0, None, None, None, None]},
        {"path": "/run/c", "version": 0}, [3], "__main__"])
