"""Logits of the Megatron model vs Hugging Face transformers on the same weights.

WHY: "the trainer and the rollout engines compute the same function" is the premise of
``rollout_vs_trainer_logprob_diff ~ 0``; this module measures it in any TP/PP/EP layout through the
worker's own forward path (Megatron schedule, so PP activations travel as in training).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def fixed_inputs(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids used by the parity checks."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def megatron_logits(worker, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits ``[B, T, vocab]`` of ``worker``'s model, returned on global rank 0 (None elsewhere).

    Collective over all ranks of the worker's job."""
    from megatron.core import parallel_state as ps

    from dora_megatron.comm.train_sample import TrainSample
    from dora_megatron.trainer.worker import build_micro_batches

    samples = [TrainSample(row.tolist()[:1], row.tolist()[1:]) for row in input_ids]
    seq_len = worker._seq_len(samples)
    # the interleaved schedule runs micro-batches in groups of pp: filler micro-batches after the real one
    count = worker.cfg.pp if len(worker.chunks) > 1 else 1
    mbs = build_micro_batches(samples, indices=list(range(len(samples))), micro_batch_size=len(samples),
                              num_micro_batches=count, seq_len=seq_len)
    store: list[torch.Tensor] = []

    def loss_fn(mb, logits):
        if worker.layout.tp > 1:
            group = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(logits) for _ in range(worker.layout.tp)]
            dist.all_gather(parts, logits.contiguous(), group=group)
            logits = torch.cat(parts, dim=-1)
        if mb.positions is not None:  # context parallel: the whole sequences from the group's parts
            from dora_megatron.trainer.worker import gather_context_parallel

            logits = gather_context_parallel(logits.contiguous(), mb, worker._cp_seq_len(mb))
        store.append(logits[:, : input_ids.shape[1], : worker.arch.vocab_size].float().cpu())
        return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

    worker._run(mbs, loss_fn, forward_only=True)
    mine = store[0] if (store and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                        and ps.get_context_parallel_rank() == 0) else None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    return next(t for t in gathered if t is not None)


@torch.no_grad()
def hf_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``transformers.AutoModelForCausalLM`` in fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    return model(input_ids).logits.float()
