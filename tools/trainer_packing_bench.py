#!/usr/bin/env python
"""Trainer tokens/s and padding with and without token-budget micro-batching, side by side.

    python tools/trainer_packing_bench.py [--config configs/cpu_tiny.yaml] [--steps 8] \
        [--budgets 1536] [--out FILE.json]

The main job's trainer (the config's ``trainer``/``algo`` sections and ``launch.trainer_threads``,
1 rank, the config's model preset with random weights) trains on the main job's workload: every
step is ``orchestrator.tbs`` groups of ``orchestrator.group_size`` samples whose prompts come from
the config's ``data`` task (the long-tailed digit lists) and whose responses are the task's
correct answers (what a warm-started policy mostly emits), with random rewards and behaviour
log-probs. Each step's batch is trained under every plan: the fixed plan (``micro_batch_size``
rows padded to the step's longest sample, ``max_tokens_per_micro_batch: 0``) and each budget in
``--budgets`` (default ``micro_batch_size * max_seq_len``: the fixed plan's largest micro-batch,
so peak activation memory does not grow). The plans alternate within each step, the order
reversed every step, so load drift on a shared machine lands on all of them alike; one warm-up
step per plan is not counted. Prints padding fraction, tokens/s (sample tokens / train_step wall
time), the median step time and each budget's tokens/s ratio to the fixed plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("trainer_packing_bench")


def workload(cfg, steps: int, seed: int) -> list[list]:
    """``steps`` batches of the config's task: prompt ids, correct-answer response ids, rewards."""
    from dora_megatron.comm.train_sample import TrainSample
    from dora_megatron.data import tokenizer as tok
    from dora_megatron.data.codec import CharCodec
    from dora_megatron.data.tasks import make_prompt_source

    source, _ = make_prompt_source(cfg.data.task, min_len=cfg.data.min_len, max_len=cfg.data.max_len,
                                   exponent=cfg.data.length_exponent, seed=cfg.data.seed + seed)
    codec, rng = CharCodec(), random.Random(seed)
    tbs, group = cfg.orchestrator.tbs, cfg.orchestrator.group_size
    batches = []
    for step in range(steps):
        batch = []
        for g in range(tbs):
            prompt = source.get(step * tbs + g)
            prompt_ids = codec.encode_prompt(prompt)
            response = tok.encode(source.target(prompt), add_bos=False) + [tok.EOS_ID]
            for _ in range(group):
                batch.append(TrainSample(prompt_ids, response, [-2.0 * rng.random() for _ in response],
                                         reward=float(rng.random() < 0.5), group_id=g))
        batches.append(batch)
    return batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/cpu_tiny.yaml")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per plan (plus one warm-up)")
    parser.add_argument("--budgets", default="", help="comma-separated max_tokens_per_micro_batch values "
                                                     "(default: micro_batch_size * max_seq_len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("megatron", "dora_megatron"):  # parameter lists and optimizer settings at start-up
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from dora_megatron.config.schema import load_config
    from dora_megatron.models.presets import create_model_dir
    from dora_megatron.trainer.worker import TrainerWorker

    cfg = load_config(args.config)
    tcfg = cfg.trainer
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [tcfg.micro_batch_size * tcfg.max_seq_len]
    plans = [0] + budgets
    tcfg.num_threads = tcfg.num_threads or cfg.launch.trainer_threads
    tcfg.max_tokens_per_micro_batch = max(budgets)  # at build time: with pp > 1 it turns on variable p2p shapes
    torch.set_num_threads(tcfg.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = cfg.model.path or str(create_model_dir(cfg.model.preset, os.path.join(tmp, "model"), seed=args.seed))
        worker = TrainerWorker(tcfg, cfg.algo, model_dir, total_steps=cfg.run.steps)
        batches = workload(cfg, args.steps + 1, args.seed)
        times: dict[int, list[float]] = {p: [] for p in plans}
        pads: dict[int, list[float]] = {p: [] for p in plans}
        tokens: list[int] = []
        for step, batch in enumerate(batches):
            order = plans if step % 2 == 0 else plans[::-1]
            for plan in order:
                worker.cfg.max_tokens_per_micro_batch = plan
                t0 = time.perf_counter()
                metrics = worker.train_step(batch)
                dt = time.perf_counter() - t0
                if step == 0:
                    continue  # warm-up
                times[plan].append(dt)
                pads[plan].append(metrics["padding_fraction"])
            if step:
                tokens.append(sum(s.tokens() for s in batch))
            log.info("step %d/%d done", step, args.steps)
        worker.close()
    total = sum(tokens)
    rows = []
    base = total / sum(times[0])
    for plan in plans:
        tps = total / sum(times[plan])
        rows.append({"max_tokens_per_micro_batch": plan, "padding_fraction": statistics.mean(pads[plan]),
                     "tokens_per_s": tps, "median_step_s": statistics.median(times[plan]),
                     "ratio_to_fixed": tps / base})
    load = os.getloadavg()
    result = {"config": args.config, "steps": args.steps, "samples_per_step": len(batches[0]),
              "tokens_per_step": statistics.mean(tokens), "trainer_threads": tcfg.num_threads,
              "cpu_count": os.cpu_count(), "loadavg": load, "plans": rows}
    print(f"{args.config}: {args.steps} steps of {len(batches[0])} samples ({statistics.mean(tokens):.0f} tokens), "
          f"{tcfg.num_threads} trainer thread(s), {os.cpu_count()} cores, load average {load[0]:.2f}")
    print(f"{'max_tokens_per_micro_batch':>26} {'padding':>8} {'tokens/s':>9} {'median step s':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['max_tokens_per_micro_batch']:>26} {r['padding_fraction']:>8.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['median_step_s']:>14.3f} {r['ratio_to_fixed']:>6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
