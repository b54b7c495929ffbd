"""Peak memory per trainer rank under each ``trainer.recompute`` setting, side by side, against the
estimate of :mod:`dora_megatron.trainer.memory`.

Usage (CPU, from the repository root; wrap in ``flock /tmp/cpu.lock`` on a shared machine):

    python tools/trainer_memory_bench.py [--seq 2048] [--samples 2] [--nproc 1 --tp 1]
        [--recompute none,selective,full] [--precision fp32] [--hf DIR] [--json out.json]

Each setting runs in a fresh process group of ``--nproc`` ranks (torchrun when > 1) so no setting
inherits another's allocator state: build the worker on the tiny MoE preset (or ``--hf``), one warm-up
step (Adam state, allocator caches), then a measured step on ``--samples`` samples of ``--seq`` tokens
(``micro_batch_size`` 1). Per rank it reports the process's peak resident set during the measured step
(``perf/trainer_peak_memory_bytes`` of that step, the trainer's own measure) and the step's growth over
the resident set at its start: on CPU the parameters, gradients and optimizer state are resident before
the step, so the growth is what the step's activations and logits take, which recompute changes and
which the estimate's ``activations + backward workspace + logits`` predicts (the rows also keep the
resident set the worker added before its first step and the estimate's model state, for ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024 ** 2


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> int:
    """One setting on this rank: prints one JSON line per rank."""
    import torch
    import torch.distributed as dist

    from dora_megatron.comm.train_sample import TrainSample
    from dora_megatron.config.algo import AlgoConfig
    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.trainer import perf
    from dora_megatron.trainer.memory import estimate
    from dora_megatron.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    import megatron.core.distributed  # noqa: F401  (the imports' memory is not the worker's)
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    cfg = TrainerConfig(tp=args.tp, device="cpu", precision=args.precision, recompute=args.child_recompute,
                        micro_batch_size=1, max_seq_len=args.seq, lr=1e-4, use_distributed_optimizer=False,
                        sequence_parallel=args.tp > 1)
    before = _rss_bytes()
    worker = TrainerWorker(cfg, AlgoConfig(), args.hf, total_steps=2)
    g = torch.Generator().manual_seed(0)
    vocab = worker.arch.vocab_size
    batch = []
    for i in range(args.samples):
        ids = torch.randint(0, vocab, (args.seq,), generator=g).tolist()
        batch.append(TrainSample(ids[: args.seq // 4], ids[args.seq // 4:], reward=float(i % 2), group_id=0))
    for s, lp in zip(batch, worker.compute_logprobs(batch)):
        s.rollout_logprobs = lp.tolist()
    built = _rss_bytes()
    worker.train_step(batch)  # warm-up: Adam state, allocator caches
    perf.reset_peak_memory("cpu")
    start = _rss_bytes()
    metrics = worker.train_step(batch)
    peak = perf.peak_memory_bytes("cpu")
    est = estimate(worker.arch, cfg, dist.get_world_size(), spec="local")
    row = {"recompute": args.child_recompute, "rank": dist.get_rank(), "peak_bytes": peak,
           "step_growth_bytes": peak - start, "worker_bytes": built - before,
           "trainer_peak_memory_bytes": metrics["perf/trainer_peak_memory_bytes"],
           "estimate_activations_logits_bytes": est.activations + est.workspace + est.logits,
           "estimate_state_bytes": est.params + est.grads + est.optimizer, "tokens_per_s": metrics["perf/trainer_tokens_per_s"]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, row)
    if dist.get_rank() == 0:
        for r in gathered:
            print("ROW " + json.dumps(r), flush=True)
    worker.close()
    return 0


def run_setting(args: argparse.Namespace, recompute: str) -> list[dict]:
    # glibc: every block >= 64 KiB its own mapping, returned on free, so the resident set follows the
    # live tensors (otherwise freed pages of the warm-up step stay resident and hide the step's growth)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = [os.path.abspath(__file__), "--child-recompute", recompute, "--hf", args.hf, "--seq", str(args.seq),
          "--samples", str(args.samples), "--tp", str(args.tp), "--precision", args.precision]
    if args.nproc > 1:
        from dora_megatron.ports import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", *me]
    else:
        cmd = [sys.executable, *me]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"setting recompute={recompute} failed")
    return [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    base = {r["rank"]: r for r in rows if r["recompute"] == "none"}
    lines = [f"trainer memory per rank: tiny MoE, {args.samples} x {args.seq} tokens, micro_batch_size 1, "
             f"tp={args.tp}, {args.nproc} rank(s), {args.precision}, cpu",
             "| recompute | rank | peak RSS (MiB) | step growth (MiB) | vs none | estimate act+workspace+logits (MiB) | "
             "growth / estimate | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = base.get(r["rank"])
        ratio = f"{r['step_growth_bytes'] / ref['step_growth_bytes']:.2f}x" if ref else "-"
        lines.append(f"| {r['recompute']} | {r['rank']} | {r['peak_bytes'] / MIB:.0f} | {r['step_growth_bytes'] / MIB:.0f} "
                     f"| {ratio} | {r['estimate_activations_logits_bytes'] / MIB:.0f} | "
                     f"{r['step_growth_bytes'] / r['estimate_activations_logits_bytes']:.2f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default="", help="HF model directory (default: the tiny-moe preset, random init)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--recompute", default="none,selective,full")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--child-recompute", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_recompute:
        return child(args)
    if not args.hf:
        from dora_megatron.models.presets import create_model_dir

        args.hf = str(create_model_dir("tiny-moe", os.path.join(tempfile.mkdtemp(prefix="dora_membench_"), "m")))
    rows = [r for setting in args.recompute.split(",") for r in run_setting(args, setting)]
    print(table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
