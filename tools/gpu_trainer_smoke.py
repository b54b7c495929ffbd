"""GPU smoke test of the Megatron trainer's production knobs: parity vs transformers, a few training
steps, tokens/s, peak memory and MFU per configuration.

Usage (on a CUDA machine, from the repo root):

    python tools/gpu_trainer_smoke.py [--only NAME[,NAME]] [--hf DIR] [--steps 3] [--json out.json]
    python tools/gpu_trainer_smoke.py --list       # the configurations
    python tools/gpu_trainer_smoke.py --dry-run    # check every configuration's keys (no GPU, no Megatron)

Each configuration of :data:`SMOKES` is what the CPU tests cannot run (Transformer Engine spec and its
fusions, grouped GEMM, the flex dispatcher, context parallelism, fp16, optimizer CPU offload) or
runs there only over gloo (bf16 with the distributed optimizer, SP/ETP, alltoall, VPP, overlapped
gradient reduction). A configuration needing more GPUs than the machine has is reported as skipped;
``flex`` also needs DeepEP. Without ``--hf`` a tiny Qwen3-MoE (4 layers, 8 experts) is created with
transformers. Every configuration runs in its own ``torch.distributed.run`` (NCCL) and prints one JSON
line: ``{"name", "ok", "max_abs_logit_diff", "losses", "grad_norm", "tokens_per_s", "peak_memory_bytes",
"mfu", ...}``; the exit status is non-zero when a configuration that ran failed its checks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO)

#: max |logit - transformers fp32| per precision (bf16: 8 mantissa bits through 4 layers)
LOGIT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25, "fp16": 0.05}
SEQ = 256


@dataclass(frozen=True)
class Smoke:
    name: str
    nproc: int
    trainer: dict = field(default_factory=dict)  # TrainerConfig fields (device cuda is implied)
    needs: str = ""  # an importable module it needs besides torch / megatron


SMOKES: tuple[Smoke, ...] = (
    Smoke("te-bf16-fusions", 1, {"precision": "bf16", "spec": "te"}),
    Smoke("te-fp16", 1, {"precision": "fp16", "spec": "te"}),
    Smoke("bf16-recompute-full", 1, {"precision": "bf16", "recompute": "full", "recompute_num_layers": 2}),
    Smoke("bf16-cpu-offload", 1, {"precision": "bf16", "optimizer_cpu_offload": True}),
    Smoke("ep2-alltoall-grouped-gemm", 2, {"precision": "bf16", "ep": 2, "moe_token_dispatcher": "alltoall",
                                           "moe_grouped_gemm": True}),
    Smoke("tp2-sp-etp1-ep2", 2, {"precision": "bf16", "tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True,
                                 "recompute": "selective"}),
    Smoke("cp2", 2, {"precision": "bf16", "cp": 2}),
    Smoke("pp2-vpp2", 2, {"precision": "bf16", "pp": 2, "vpp": 2}),
    Smoke("dp2-overlap-grad-reduce", 2, {"precision": "bf16", "overlap_grad_reduce": True}),
    Smoke("ep2-flex", 2, {"precision": "bf16", "ep": 2, "moe_token_dispatcher": "flex", "moe_grouped_gemm": True},
          needs="deep_ep"),
)

TINY_MOE = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
                norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096)


def trainer_config(smoke: Smoke):
    from dora_megatron.config.trainer import TrainerConfig

    return TrainerConfig(device="cuda", lr=1e-5, micro_batch_size=4, max_seq_len=max(4096, SEQ),
                         lr_warmup_steps=1, **smoke.trainer)


def dry_run() -> int:
    """Check every smoke's keys as ``dora train`` would (config rules, world fit, shape rules)."""
    from dora_megatron.config.base import ConfigError
    from dora_megatron.launch.layout import trainer_section_problems

    hf_config = {"model_type": "qwen3_moe", **TINY_MOE}
    bad = 0
    for smoke in SMOKES:
        cfg = trainer_config(smoke)
        try:
            cfg.check("trainer")
            cfg.data_parallel_size(smoke.nproc)
            problems = trainer_section_problems(hf_config, cfg)
        except ConfigError as err:
            problems = [str(err)]
        bad += bool(problems)
        status = "OK" if not problems else "PROBLEM: " + "; ".join(problems)
        print(f"{smoke.name:28s} nproc={smoke.nproc} {json.dumps(smoke.trainer)} {status}")
    return 1 if bad else 0


def _tiny_moe(path: str) -> str:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_MOE)).save_pretrained(path)
    return path


def run_rank(smoke: Smoke, hf: str, steps: int) -> int:
    """This rank's part of one smoke (started by torch.distributed.run)."""
    import torch
    import torch.distributed as dist

    from dora_megatron.comm.train_sample import TrainSample
    from dora_megatron.config.algo import AlgoConfig
    from tests.helpers.trainer_parity import fixed_inputs, hf_logits, megatron_logits
    from dora_megatron.trainer.worker import TrainerWorker

    cfg = trainer_config(smoke)
    worker = TrainerWorker(cfg, AlgoConfig(), hf, total_steps=steps + 1)
    vocab = worker.arch.vocab_size
    ids = fixed_inputs(vocab, seq_len=64)
    ours = megatron_logits(worker, ids)
    diff = (ours - hf_logits(hf, ids)).abs().max().item() if ours is not None else None
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(16):
        prompt = torch.randint(0, vocab, (SEQ // 4,), generator=g).tolist()
        resp = torch.randint(0, vocab, (SEQ - len(prompt),), generator=g).tolist()
        batch.append(TrainSample(prompt, resp, reward=float(i % 2), group_id=i // 4))
    for s, lp in zip(batch, worker.compute_logprobs(batch)):
        s.rollout_logprobs = lp.tolist()
    steps_out = [worker.train_step(batch) for _ in range(steps)]
    if dist.get_rank() == 0:
        last = steps_out[-1]
        losses = [m["loss"] for m in steps_out]
        ok = (diff is not None and diff < LOGIT_TOLERANCE[cfg.precision]
              and all(m["update_successful"] or cfg.precision == "fp16" for m in steps_out)
              and all(x == x for x in losses))  # no NaN
        print("SMOKE " + json.dumps({
            "name": smoke.name, "ok": bool(ok), "spec": worker.spec, "world": dist.get_world_size(),
            "max_abs_logit_diff": diff, "losses": losses, "grad_norm": last["grad_norm"], "lr": last["lr"],
            "tokens_per_s": last["perf/trainer_tokens_per_s"], "peak_memory_bytes": last["perf/trainer_peak_memory_bytes"],
            "mfu": last.get("perf/trainer_mfu")}), flush=True)
    worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default="")
    parser.add_argument("--only", default="", help="comma-separated smoke names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default="")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--rank-of", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    by_name = {s.name: s for s in SMOKES}
    if args.rank_of:
        return run_rank(by_name[args.rank_of], args.hf, args.steps)
    if args.list:
        for s in SMOKES:
            print(f"{s.name:28s} nproc={s.nproc} {json.dumps(s.trainer)}{' needs ' + s.needs if s.needs else ''}")
        return 0
    if args.dry_run:
        return dry_run()
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("gpu_trainer_smoke: this needs CUDA (use --dry-run to check the configurations)\n")
        return 2
    gpus = torch.cuda.device_count()
    hf = args.hf or _tiny_moe(os.path.join(tempfile.mkdtemp(prefix="dora_smoke_"), "moe"))
    chosen = [by_name[n] for n in args.only.split(",")] if args.only else list(SMOKES)
    results, failed = [], 0
    for smoke in chosen:
        if smoke.nproc > gpus or (smoke.needs and importlib.util.find_spec(smoke.needs) is None):
            why = f"needs {smoke.nproc} GPUs, {gpus} present" if smoke.nproc > gpus else f"needs {smoke.needs}"
            res = {"name": smoke.name, "skipped": why}
        else:
            from dora_megatron.ports import free_port

            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={smoke.nproc}",
                   f"--master_port={free_port()}", os.path.abspath(__file__), "--rank-of", smoke.name, "--hf", hf,
                   "--steps", str(args.steps)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            lines = [ln[6:] for ln in proc.stdout.splitlines() if ln.startswith("SMOKE ")]
            res = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "name": smoke.name, "ok": False, "error": (proc.stdout + proc.stderr)[-2000:]}
            failed += not res.get("ok")
        results.append(res)
        print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
