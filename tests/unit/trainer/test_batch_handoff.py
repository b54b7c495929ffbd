"""``/train`` with a batch directory: the client writes it off the loop, each data-parallel rank
of the service reads only the rows its plan trains, a bad directory is a 400 naming the field."""

from __future__ import annotations

import asyncio
import socket
import threading
from array import array
from pathlib import Path

import pytest

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


def _samples(n: int) -> list[dict]:
    return [{"prompt_ids": [1, 2, 3], "response_ids": array("i", range(10, 10 + 2 + i)),
             "rollout_logprobs": array("f", [-0.25] * (2 + i)), "reward": float(i % 2), "group_id": f"g{i // 2}",
             "version": 0} for i in range(n)]


def _serve(svc: TrainerService) -> tuple[int, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = threading.Thread(target=svc.leader_loop, args=("127.0.0.1", port), daemon=True)
    t.start()
    return port, t


def test_client_writes_a_batch_each_rank_trains_its_own_rows(tmp_path):
    samples = _samples(7)
    leader = ShardWorker(dp=2, dp_rank=0)
    svc = TrainerService(leader, run_dir=tmp_path, rank=0, world_size=2)
    port, thread = _serve(svc)
    sent: dict = {}

    async def go():
        c = TrainerClient(f"http://127.0.0.1:{port}", batch_dir=tmp_path / "batches")
        try:
            while await c.health() is None:
                await asyncio.sleep(0.02)
            original = c._post

            async def spy(path, body):
                sent.update(body)  # what the other rank gets broadcast: the entry, no token
                return await original(path, body)

            c._post = spy
            return await c.train(0, samples)
        finally:
            await c.shutdown()
            await c.close()

    reply = asyncio.run(go())
    thread.join(timeout=10)
    assert "samples" not in sent and len(sent["batch"]["samples"]) == 7
    assert not (tmp_path / "batches" / "step_000000").exists()  # gone once the trainer answered
    rows0 = leader.data_rows([3 + 2 + i for i in range(7)])
    assert 0 < len(rows0) < 7
    assert reply["batch_bytes_read"] == sum(4 * 3 + 8 * (2 + i) for i in rows0)
    assert [s.response_ids.tolist() for s in leader.trained if s.response_ids.flags.owndata] == \
        [list(samples[i]["response_ids"]) for i in rows0]


def test_other_rank_reads_the_complement(tmp_path):
    from dora_megatron.comm.batch_files import write_batch

    samples = _samples(7)
    entry = write_batch(tmp_path / "b", samples)
    out = {}
    for rank in (0, 1):
        w = ShardWorker(dp=2, dp_rank=rank)
        svc = TrainerService(w, run_dir=tmp_path, rank=rank, world_size=2)
        out[rank] = svc.execute(Command("train", {"step": 0, "batch": entry}))["batch_bytes_read"]
    total = sum(4 * 3 + 8 * (2 + i) for i in range(7))
    assert out[0] + out[1] == total and out[0] and out[1]


def test_bad_batch_directory_is_a_400_naming_it(tmp_path):
    svc = TrainerService(ShardWorker(1, 0), run_dir=tmp_path, rank=0, world_size=1)
    with pytest.raises(BadRequest, match="batch.dir"):
        svc.execute(Command("train", {"step": 0, "batch": {"dir": str(tmp_path / "nope"),
                                                          "samples": [{"prompt_tokens": 1, "response_tokens": 1,
                                                                       "reward": 0.0, "group_id": "g"}]}}))
    port, thread = _serve(svc)

    async def go():
        c = TrainerClient(f"http://127.0.0.1:{port}")
        try:
            while await c.health() is None:
                await asyncio.sleep(0.02)
            with pytest.raises(TrainerError, match=r"400.*batch\.samples\[0\]\.response_tokens"):
                await c._post("/train", {"step": 0, "batch": {"dir": str(tmp_path), "samples": [{"prompt_tokens": 1}]}})
        finally:
            await c.shutdown()
            await c.close()

    asyncio.run(go())
    thread.join(timeout=10)
