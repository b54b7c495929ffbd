"""Supervised warm start: teach a freshly initialised tiny model the task format.

Why: RL from random weights on a 128-token vocabulary never samples a correct
answer, so the reward is flat. A few minutes of supervised traces (prompt ->
answer) on CPU give the tiny MoE model a non-trivial success rate on short lists
and a low one on the long tail, which is where RL then has room to improve.

Trains the Hugging Face implementation (``transformers``) of the model in the
directory, then writes the weights back in the per-expert layout. Sequences are
``<bos> prompt answer . <eos>``; the loss covers only the response tokens, the
same tokens the RL loss sees.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import DIGIT_TASKS, RunningSumTask

log = logging.getLogger(__name__)

#: Warm-start prompts come from a seed far from the RL stream's so the RL prompts are unseen.
WARM_START_SEED_OFFSET = 7_919


@dataclass
class WarmStartResult:
    steps: int
    final_loss: float
    exact_short: float  # teacher-forced exact-match rate on lists of <= 5 digits
    exact_long: float   # same on longer lists
    seconds: float


def encode_example(prompt: str, response: str) -> tuple[list[int], int]:
    """Token ids of ``<bos> prompt response <eos>`` and the index where the response starts."""
    from dora_megatron.data.codec import CharCodec

    p = CharCodec().encode_prompt(prompt)  # the controller's rendering of the prompt
    r = tok.encode(response) + [tok.EOS_ID]
    return p + r, len(p)


def _batch(examples: list[tuple[list[int], int]]):
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), tok.PAD_ID, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, start) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, start: len(ids)] = torch.tensor(ids[start:])
        mask[row, : len(ids)] = 1
    return input_ids, labels, mask


def warm_start(
    model_dir: str | Path,
    task: RunningSumTask,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> WarmStartResult:
    """Train the model in ``model_dir`` in place on ``task`` traces for ``steps`` optimizer steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from dora_megatron.models import hf_model_dir

    t0 = time.monotonic()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))) + 0.02
    )
    rng = random.Random(seed)
    base = (seed + WARM_START_SEED_OFFSET) * 1_000_000
    loss_value = float("nan")
    for step in range(steps):
        examples = []
        for _ in range(batch_size):
            p = task.get(base + rng.randrange(1 << 30))
            examples.append(encode_example(p.text, task.target(p)))
        input_ids, labels, mask = _batch(examples)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(out.loss.detach())
        if progress is not None:
            progress(step + 1, loss_value)
    model.eval()
    short, long_ = _exact_rates(model, task, seed)
    state = hf_model_dir.unfuse_experts({k: v.detach() for k, v in model.state_dict().items()})
    config = hf_model_dir.load_config(model_dir)
    hf_model_dir.save_model_dir(model_dir, config, state)
    return WarmStartResult(steps, loss_value, short, long_, time.monotonic() - t0)


def _exact_rates(model, task: RunningSumTask, seed: int, n: int = 256) -> tuple[float, float]:
    """Teacher-forced argmax exact match (equals greedy decoding exact match) on held-out prompts."""
    import torch

    hits = {True: [0, 0], False: [0, 0]}
    base = (seed + WARM_START_SEED_OFFSET + 1) * 1_000_000
    examples = []
    for i in range(n):
        p = task.get(base + i)
        examples.append((encode_example(p.text, task.target(p)), len(p.answer) <= 5))
    with torch.no_grad():
        for start in range(0, n, 64):
            chunk = examples[start: start + 64]
            input_ids, labels, mask = _batch([e for e, _ in chunk])
            logits = model(input_ids=input_ids, attention_mask=mask).logits
            pred = logits[:, :-1].argmax(-1)
            target = labels[:, 1:]
            ok = ((pred == target) | (target == -100)).all(dim=1)
            for row, (_, is_short) in enumerate(chunk):
                hits[is_short][0] += int(ok[row])
                hits[is_short][1] += 1
    rate = lambda h: h[0] / h[1] if h[1] else float("nan")  # noqa: E731
    return rate(hits[True]), rate(hits[False])


def run_warm_start(model_dir: str | Path, task_name: str, steps: int, seed: int = 0,
                   say: Callable[[str], None] = log.info, task_kwargs: dict | None = None) -> WarmStartResult:
    """Warm-start ``model_dir`` on the named task with progress lines every ~10% of the steps."""
    if task_name not in DIGIT_TASKS:
        raise ValueError(f"warm start: unknown task {task_name!r} (valid: {', '.join(DIGIT_TASKS)})")
    task = RunningSumTask(kind=task_name, **(task_kwargs or {}))
    every = max(1, steps // 10)

    def progress(step: int, loss: float) -> None:
        if step % every == 0 or step == steps:
            say(f"warm start on {task_name}: step {step}/{steps} loss {loss:.4f}")

    result = warm_start(model_dir, task, steps=steps, seed=seed, progress=progress)
    say(f"warm start done in {result.seconds:.0f} s: exact answers {result.exact_short:.0%} on lists <= 5 digits, "
        f"{result.exact_long:.0%} on longer lists (teacher-forced greedy)")
    return result
