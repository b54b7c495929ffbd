"""GPU smoke test of the Megatron trainer: parity vs transformers, one training step, tokens/s.

Usage (on a CUDA machine, from the repo root):

    python tools/gpu_trainer_smoke.py [--hf DIR] [--nproc N --tp N --pp N --ep N] [--steps 3]

Without ``--hf`` it creates a tiny Qwen3-MoE model (transformers, fp32) in a temp dir. With
``--nproc > 1`` it relaunches itself under ``torch.distributed.run`` (NCCL). Uses the Transformer
Engine spec when ``transformer_engine`` imports, Megatron's local spec otherwise. Rank 0 prints one
JSON line: ``{"spec", "layout", "max_abs_logit_diff", "loss", "grad_norm", "tokens_per_s", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_moe(path: str) -> str:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=256, intermediate_size=512, norm_topk_prob=True,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default="")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="samples per step")
    parser.add_argument("--seq", type=int, default=256, help="prompt+response tokens per sample")
    args = parser.parse_args(argv)
    if not args.hf and os.environ.get("RANK", "0") == "0" and "DORA_SMOKE_HF" not in os.environ:
        args.hf = _tiny_moe(os.path.join(tempfile.mkdtemp(prefix="dora_smoke_"), "moe"))
    args.hf = args.hf or os.environ.get("DORA_SMOKE_HF", "")
    if args.nproc > 1 and "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               f"--master_port={_free_port()}", os.path.abspath(__file__), "--hf", args.hf,
               "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep), "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq)]
        return subprocess.call(cmd, env=dict(os.environ, DORA_SMOKE_HF=args.hf))

    import torch
    import torch.distributed as dist

    from dora_megatron.config.algo import AlgoConfig
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.trainer.parity import fixed_inputs, hf_logits, megatron_logits
    from dora_megatron.trainer.worker import TrainerWorker

    assert torch.cuda.is_available(), "this smoke test needs CUDA"
    cfg = TrainerConfig(tp=args.tp, pp=args.pp, ep=args.ep, device="cuda", lr=1e-5, micro_batch_size=4,
                        max_seq_len=max(4096, args.seq))
    worker = TrainerWorker(cfg, AlgoConfig(), args.hf)
    vocab = worker.arch.vocab_size
    ids = fixed_inputs(vocab, seq_len=64)
    ours = megatron_logits(worker, ids)
    diff = None
    if ours is not None:
        diff = (ours - hf_logits(args.hf, ids)).abs().max().item()
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(args.batch):
        prompt = torch.randint(0, vocab, (args.seq // 4,), generator=g).tolist()
        resp = torch.randint(0, vocab, (args.seq - len(prompt),), generator=g).tolist()
        batch.append({"prompt_ids": prompt, "response_ids": resp, "reward": float(i % 2), "group_id": i // 4})
    for s, lp in zip(batch, worker.compute_logprobs(batch)):
        s["rollout_logprobs"] = lp.tolist()
    metrics = {}
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = worker.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch)
    best = min(times[1:] or times)
    if dist.get_rank() == 0:
        print(json.dumps({"spec": worker.spec, "layout": [args.tp, args.pp, args.ep], "world": dist.get_world_size(),
                          "max_abs_logit_diff": diff, "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
                          "rollout_vs_trainer_logprob_diff": metrics.get("rollout_vs_trainer_logprob_diff"),
                          "step_seconds": times, "tokens_per_s": tokens / best}), flush=True)
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
