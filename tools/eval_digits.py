"""Held-out evaluation of model directories on a marked-digit task, per list-length bucket.

The same evaluation `dora train` runs at the end of a job (``observability.heldout_prompts``),
for any model directories: the initial model, any ``RUN_DIR/weights/vNNNNNN`` snapshot.

    python tools/eval_digits.py RUN_DIR/model RUN_DIR/weights/v000200 --task digit_cipher \\
        --length-exponent 1.2 --prompts 400 --decode sample greedy

The results (one line per model and decode) go to stdout, so that they can be piped or
redirected; logging and the libraries' progress bars stay on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("eval_digits")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="Hugging Face model directories (RUN_DIR/model, RUN_DIR/weights/vNNNNNN)")
    parser.add_argument("--task", default="digit_cipher", help="digit task name (data.task)")
    parser.add_argument("--min-len", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=40)
    parser.add_argument("--length-exponent", type=float, default=1.2)
    parser.add_argument("--data-seed", type=int, default=0, help="the run's data.seed (held-out prompts use it + 99)")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--decode", nargs="+", default=["sample", "greedy"], choices=["sample", "greedy"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off (the rollout default)")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", default=[],
                        help="extra token ids that end an answer (rollout.stop_token_ids); EOS always does")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from dora_megatron.observability.heldout import evaluate_model, heldout_prompts

    torch.set_num_threads(args.threads)
    prompts = heldout_prompts(args.task, args.min_len, args.max_len, args.length_exponent, args.data_seed, args.prompts)
    results = []
    for decode in args.decode:
        for model_dir in args.models:
            log.info("evaluating %s (%s, %d prompts)", model_dir, decode, len(prompts))
            res = evaluate_model(model_dir, prompts, decode, temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, stop_token_ids=args.stop_token_ids,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed)
            results.append(res.to_json())
            # a result, not a log line: stdout, apart from the progress output on stderr
            print(f"{res.line()}  {model_dir}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
