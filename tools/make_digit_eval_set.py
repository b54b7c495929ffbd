"""Write a held-out eval set of a digit task in verl's row layout, for ``data.eval_path``.

The digit tasks draw their prompts from a seeded stream (``data.seed``); the eval set holds the
same held-out prompts ``observability.heldout_prompts`` answers after a run (the prompt seed
``data.seed + HELDOUT_SEED_OFFSET``, same generator, same length distribution), which the
training stream is unlikely to repeat (only the shortest prompts, of which there are few, can
recur). As a file it is answered on the engines during the run (``observability.eval_interval``). Rows are ``{"prompt": TEXT, "reward_model": {"ground_truth": ANSWER}, "data_source":
TASK}``, read like any prompt dataset and scored by the task's own reward.

    python tools/make_digit_eval_set.py --config configs/bench/cpu_longtail.yaml --prompts 32 \\
        --out configs/bench/digit_cipher_eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dora_megatron.config.loader import from_dict, read_yaml
from dora_megatron.config.schema import DoraConfig
from dora_megatron.data.tasks import DIGIT_TASKS
from dora_megatron.observability.heldout import HELDOUT_SEED_OFFSET, heldout_prompts

log = logging.getLogger("make_digit_eval_set")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the job's config: its data.task, min_len, max_len, length_exponent")
    ap.add_argument("--prompts", type=int, default=32, help="rows to write (default 32)")
    ap.add_argument("--out", required=True, help="the JSON lines file to write")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = from_dict(DoraConfig, read_yaml(args.config))
    d = cfg.data
    if d.task not in DIGIT_TASKS:
        log.error("%s: data.task %r is not a digit task (%s)", args.config, d.task, ", ".join(DIGIT_TASKS))
        return 2
    if args.prompts < 1:
        log.error("--prompts must be >= 1, got %d", args.prompts)
        return 2
    prompts = heldout_prompts(d.task, d.min_len, d.max_len, d.length_exponent, d.seed, args.prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text, "reward_model": {"ground_truth": p.answer}, "data_source": d.task}) + "\n")
    log.info("%s: %d held-out %s prompts (prompt seed %d)", out, args.prompts, d.task, d.seed + HELDOUT_SEED_OFFSET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
