"""Held-out evaluation of model directories on a marked-digit task, per list-length bucket.

Why: the training reward of an RL run mixes prompts of every length and moves with the sampling
noise of a few groups per step; a fixed set of held-out prompts (a prompt seed the run never
uses) evaluated the same way before and after training says whether the policy improved, and
where. Sampling at temperature 1 measures the quantity RL optimises; greedy decoding shows
whether the most likely answer improved too.

    python tools/eval_digits.py RUN_DIR/model RUN_DIR/weights/v000200 --task digit_cipher \\
        --length-exponent 1.2 --prompts 400 --decode sample greedy
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKETS = (1, 2, 4, 8, 16, 52)
log = logging.getLogger("eval_digits")


def bucket_of(n: int) -> int:
    return next(b for b in BUCKETS if n <= b)


def evaluate(model_dir: str, prompts, decode: str, batch: int, max_new_tokens: int, seed: int) -> dict:
    """Exact-answer rate overall and per length bucket (``n <= b``) for one model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from dora_megatron.data import tokenizer as tok
    from dora_megatron.data.tasks import running_sum_reward

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    per_bucket: dict[int, list[float]] = {}
    for start in range(0, len(prompts), batch):
        chunk = prompts[start: start + batch]
        ids = [tok.encode(p.text, add_bos=True) for p in chunk]
        width = max(map(len, ids))
        inp = torch.tensor([[tok.PAD_ID] * (width - len(x)) + x for x in ids])  # left padding
        with torch.no_grad():
            out = model.generate(input_ids=inp, attention_mask=(inp != tok.PAD_ID).long(),
                                 do_sample=decode == "sample", temperature=1.0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.EOS_ID, pad_token_id=tok.PAD_ID)
        for p, row in zip(chunk, out[:, width:].tolist()):
            reward = running_sum_reward(tok.decode(row), p.answer)
            per_bucket.setdefault(bucket_of(len(p.answer) // 2), []).append(reward)
    rewards = [r for rs in per_bucket.values() for r in rs]
    return {"model": model_dir, "decode": decode, "exact": statistics.fmean(rewards),
            "buckets": {f"n<={b}": {"exact": statistics.fmean(per_bucket[b]), "prompts": len(per_bucket[b])}
                        for b in sorted(per_bucket)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="Hugging Face model directories (RUN_DIR/model, RUN_DIR/weights/vNNNNNN)")
    parser.add_argument("--task", default="digit_cipher", help="digit task name (data.task)")
    parser.add_argument("--min-len", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=40)
    parser.add_argument("--length-exponent", type=float, default=1.2)
    parser.add_argument("--prompt-seed", type=int, default=99, help="seed of the held-out prompt stream (runs use data.seed, default 0)")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--decode", nargs="+", default=["sample", "greedy"], choices=["sample", "greedy"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from dora_megatron.data.tasks import RunningSumTask

    torch.set_num_threads(args.threads)
    task = RunningSumTask(args.min_len, args.max_len, args.length_exponent, seed=args.prompt_seed, kind=args.task)
    prompts = [task.get(i) for i in range(args.prompts)]
    results = []
    for decode in args.decode:
        for model_dir in args.models:
            res = evaluate(model_dir, prompts, decode, args.batch, args.max_new_tokens, args.seed)
            results.append(res)
            buckets = " ".join(f"{k}:{v['exact']:.2f}" for k, v in res["buckets"].items())
            log.info("%-8s exact %.3f  %s  %s", decode, res["exact"], buckets, model_dir)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
