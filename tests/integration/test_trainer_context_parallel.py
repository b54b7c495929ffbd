"""The trainer's context-parallel plumbing on 2 gloo ranks (no model: TE's attention is CUDA-only):
each rank gets Megatron's load-balanced chunks of every per-token field, and the gather used by the
log-prob pass rebuilds whole sequences on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dora_megatron.ports import free_port

pytestmark = pytest.mark.integration


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from dora_megatron.trainer import cpu_compat

    handle = cpu_compat.activate("cpu")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    from dora_megatron.comm.train_sample import TrainSample
    from dora_megatron.trainer.worker import context_parallel_part, gather_context_parallel, pad_micro_batch

    ps.initialize_model_parallel(context_parallel_size=2, create_gloo_process_groups=True)
    try:
        samples = [TrainSample([1, 2, 3], [4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0]), TrainSample([9], [8, 7], [-5.0, -6.0])]
        mb = pad_micro_batch(samples, [0, 1], 8)
        part = context_parallel_part(mb)
        pos = part.positions[0]
        for name in ("tokens", "targets", "loss_mask", "rollout_logprobs", "position_ids"):
            assert torch.equal(getattr(part, name), getattr(mb, name)[:, pos]), name
        assert torch.equal(part.attention_mask, mb.attention_mask[:, :, pos])
        assert torch.equal(gather_context_parallel(part.rollout_logprobs, part, 8), mb.rollout_logprobs)
        out[rank] = pos.tolist()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        handle.deactivate()


def test_chunks_are_load_balanced_and_gather_rebuilds_whole_sequences():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(free_port(), out), nprocs=2)
        # 2 * cp = 4 chunks of 2 positions: rank 0 holds the first and the last, rank 1 the middle two
        assert dict(out) == {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
