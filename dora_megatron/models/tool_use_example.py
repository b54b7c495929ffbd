"""A tool-use task a tiny model can only solve with its calculator, and the model directory for it.

Why: the tool-calling workflow (``rollout.workflow: tool_calling``) needs a model that writes
Qwen3's ``<tool_call>`` blocks and a chat template that renders ``tools=``; the presets have
neither. This module writes, at toy size and in a few minutes of CPU:

* ``model/``: a tiny Qwen3-MoE saved by transformers with a byte-level BPE tokenizer
  (:func:`~dora_megatron.models.example.build_tokenizer`), the ``<tool_call>`` / ``</tool_call>``
  tokens and :data:`TOOL_TEMPLATE`, warm-started (supervised, 120 steps) on whole
  trajectories of the task, rendered exactly as the workflow renders them: so the model knows
  the call format and where the result goes, not yet how to do it reliably (room for RL).
  The warm start mixes in direct answers (no call, an estimate from the operands' leading
  digits, practically always wrong; ``direct_share`` of the trajectories; the loss covers their
  first token, the decision not to call): the warm-started
  policy calls its calculator in only part of its trajectories, and RL, rewarded for the right
  product only (never for the call), has to find out that calling pays.
* ``train.parquet``: DAPO-shaped rows: "What is A * B?" with A and B of :data:`DIGITS` digits
  (a product of up to 10 digits: no tiny model multiplies that in its head; with the calculator
  it has to copy the operands into the call and the result into ``\\boxed{}``).

The reward that goes with it is ``examples/tool_use/reward.py`` (1 for the exact product in
``\\boxed{}``; the reward sees the model's tokens only, never the tool's result).
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

DATA_SOURCE = "example/long_multiplication"
SYSTEM_PROMPT = "Use the calculator for arithmetic. Answer with \\boxed{the number}."
DIGITS = 5
#: share of direct answers (no call) in the warm start: the warm-started policy calls its calculator
#: in about the rest of its trajectories, so the tool-use rate has room to rise under RL
DIRECT_SHARE = 0.7
#: warm-start prompts come from a seed far from the rows' so the RL prompts are unseen
WARM_START_SEED_OFFSET = 104_729

#: A Qwen3-style tool template: ``tools=`` are listed in the system turn inside ``<tools>``, the
#: model answers with ``<tool_call>`` blocks, and consecutive ``tool`` messages are rendered together
#: as one user turn of ``<tool_response>`` blocks. Data of the example model, rendered only by
#: transformers (written for this project, not Qwen's file).
TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def add_tool_template(tokenizer: Any) -> Any:
    """``tokenizer`` with the ``<tool_call>`` tokens (ordinary added tokens, as in Qwen3's) and
    :data:`TOOL_TEMPLATE`."""
    tokenizer.add_tokens(list(TOOL_TOKENS))
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def problem(rng: random.Random) -> tuple[int, int]:
    lo, hi = 10 ** (DIGITS - 1), 10 ** DIGITS - 1
    return rng.randint(lo, hi), rng.randint(lo, hi)


def messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {a} * {b}?"}]


def call_text(a: int, b: int) -> str:
    """The model's first turn: one calculator call."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}) + "\n</tool_call>"


def answer_text(value: int) -> str:
    return f"The answer is \\boxed{{{value}}}."


def estimate(a: int, b: int) -> int:
    """A direct answer's product: the operands rounded to thousands and multiplied (what one might
    say without a calculator; exact only when both operands are multiples of 1,000)."""
    return round(a, -3) * round(b, -3)


def rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """DAPO-shaped rows (chat ``prompt``, ``reward_model.ground_truth``, ...)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = problem(rng)
        out.append({"data_source": DATA_SOURCE, "prompt": messages(a, b), "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                    "extra_info": {"index": i, "split": "train", "a": a, "b": b}})
    return out


@dataclass(frozen=True)
class Trace:
    """A teacher trajectory in token ids: ``ids`` = prompt, call turn, tool result, answer turn;
    ``labels`` are 1 on the model's tokens (the two turns), 0 elsewhere."""

    ids: list[int]
    labels: list[int]


def trace(tokenizer: Any, eos_id: int, a: int, b: int) -> Trace:
    """The trajectory the workflow would build if the model answered perfectly, token for token
    as the workflow renders it (:func:`~dora_megatron.workflow.tool_calling.render`,
    :func:`~dora_megatron.workflow.tool_calling.env_tokens`)."""
    from dora_megatron.workflow.tool_calling import env_tokens, render
    from dora_megatron.workflow.tools import Calculator

    prompt = render(tokenizer, messages(a, b), generation_prompt=True, tools=[Calculator.schema])
    call = tokenizer.encode(call_text(a, b), add_special_tokens=False) + [eos_id]
    env = env_tokens(tokenizer, [{"role": "tool", "content": str(a * b)}], [eos_id])
    answer = tokenizer.encode(answer_text(a * b), add_special_tokens=False) + [eos_id]
    return Trace(prompt + call + env + answer, [0] * len(prompt) + [1] * len(call) + [0] * len(env) + [1] * len(answer))


def direct_trace(tokenizer: Any, eos_id: int, a: int, b: int) -> Trace:
    """A one-turn trajectory without the calculator: the :func:`estimate` in ``\\boxed{}``.

    Only its first token is labelled: that token is the decision not to call. The digits of a
    product no tiny model can compute would only be noise that drowns the copy the calculator
    trajectories teach (with the whole direct answer in the loss, 120 steps at a 0.7 share ended
    at loss 0.65 and no exact answer turn); the rest of a direct answer the model writes as it
    learned to write answers."""
    from dora_megatron.workflow.tool_calling import render
    from dora_megatron.workflow.tools import Calculator

    prompt = render(tokenizer, messages(a, b), generation_prompt=True, tools=[Calculator.schema])
    answer = tokenizer.encode(answer_text(estimate(a, b)), add_special_tokens=False) + [eos_id]
    return Trace(prompt + answer, [0] * len(prompt) + [1] + [0] * (len(answer) - 1))


@dataclass(frozen=True)
class WarmStartReport:
    steps: int
    final_loss: float
    exact_calls: float  # teacher-forced greedy: the call turn right after its first token
    exact_answers: float  # the whole answer turn right (given the right tool result)
    call_probability: float  # mean probability of <tool_call> as the first token of the first turn
    seconds: float


def direct_count(batch_size: int, direct_share: float) -> int:
    """Direct answers added to ``batch_size`` calculator trajectories so they make ``direct_share``
    of the batch: the calculator trajectories stay ``batch_size`` whatever the share, so the copy
    from the tool's result is taught as much as without direct answers."""
    if not 0.0 <= direct_share < 1.0:
        raise ValueError(f"direct_share: {direct_share} (must be in [0, 1))")
    return round(batch_size * direct_share / (1.0 - direct_share))


def warm_start(model_dir: Path, tokenizer: Any, eos_id: int, steps: int, seed: int = 0, batch_size: int = 16,
               lr: float = 2e-3, direct_share: float = 0.0,
               progress: Callable[[int, float], None] | None = None) -> WarmStartReport:
    """Supervised steps on teacher trajectories (loss on the model's turns only), in place: each
    step ``batch_size`` calculator trajectories and :func:`direct_count` direct answers."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed + WARM_START_SEED_OFFSET)
    n_direct = direct_count(batch_size, direct_share)
    loss_value = float("nan")
    for step in range(steps):
        batch = [trace(tokenizer, eos_id, *problem(rng)) for _ in range(batch_size)]
        batch += [direct_trace(tokenizer, eos_id, *problem(rng)) for _ in range(n_direct)]
        ids, labels, mask = _tensors(batch, tokenizer.pad_token_id or 0)
        for group in opt.param_groups:  # warm-up, then linear decay to a tenth
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1.0 - 0.9 * step / max(1, steps))
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(out.loss.detach())
        if progress is not None:
            progress(step + 1, loss_value)
    model.eval()
    calls, answers, p_call = _exact(model, tokenizer, eos_id, seed)
    model.to(torch.bfloat16).save_pretrained(str(model_dir))
    return WarmStartReport(steps, loss_value, calls, answers, p_call, time.monotonic() - t0)


def _tensors(batch: list[Trace], pad: int):
    import torch

    width = max(len(t.ids) for t in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, t in enumerate(batch):
        ids[row, :len(t.ids)] = torch.tensor(t.ids)
        mask[row, :len(t.ids)] = 1
        keep = torch.tensor(t.labels, dtype=torch.bool)
        labels[row, :len(t.ids)] = torch.where(keep, torch.tensor(t.ids), torch.tensor(-100))
    return ids, labels, mask


def _exact(model: Any, tokenizer: Any, eos_id: int, seed: int, n: int = 64) -> tuple[float, float, float]:
    """Teacher-forced greedy exact match of the call turn (after its first token) and of the answer
    turn on unseen problems, and the mean probability that the first turn starts with ``<tool_call>``."""
    import torch

    rng = random.Random(seed + WARM_START_SEED_OFFSET + 1)
    batch = [trace(tokenizer, eos_id, *problem(rng)) for _ in range(n)]
    ids, labels, mask = _tensors(batch, tokenizer.pad_token_id or 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    pred = logits.argmax(-1)
    first = torch.softmax(logits.float(), -1)[..., tokenizer.convert_tokens_to_ids(TOOL_TOKENS[0])]
    target = labels[:, 1:]
    calls = answers = 0
    p_call = 0.0
    for row, t in enumerate(batch):
        spans = _runs(t.labels)
        # the call turn's first token is the decision to call, which direct answers make uncertain
        # on purpose (its probability is p_call); the rest of the turn is what must be exact
        ok = [bool(((pred[row, s:e - 1] == target[row, s:e - 1])).all()) for s, e in spans]
        calls += ok[0]
        answers += ok[-1]
        p_call += float(first[row, spans[0][0] - 1])
    return calls / n, answers / n, p_call / n


def _runs(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    out, start = [], None
    for i, v in enumerate(labels + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


@dataclass(frozen=True)
class ToolUseExample:
    model_dir: Path
    data: Path
    warm_start: WarmStartReport | None


def write_tool_use_example(out: str | Path, *, rows_count: int = 512, seed: int = 0, warm_start_steps: int = 120,
                           direct_share: float = DIRECT_SHARE,
                           say: Callable[[str], None] = log.info) -> ToolUseExample:
    """Write ``out/model`` (tokenizer with the tool template, a tiny Qwen3-MoE, warm-started for
    ``warm_start_steps`` steps, ``direct_share`` of its trajectories direct answers) and
    ``out/train.parquet`` (``rows_count`` rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dora_megatron.models.example import build_tokenizer, save_tiny_model
    from dora_megatron.workflow.tools import Calculator

    out = Path(out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    data = rows(rows_count, seed)
    # the BPE learns the template's fixed text and the turns' shapes, but no digit string: every digit
    # stays one token, so copying a number is copying its digits one by one
    fixed = TOOL_TEMPLATE + json.dumps(Calculator.schema) + SYSTEM_PROMPT
    shapes = call_text(0, 0) + answer_text(0) + "What is 0 * 0?\n<tool_response>\n0\n</tool_response>"
    corpus = [re.sub(r"[0-9]+", " ", text) for text in [fixed] * 20 + [shapes] * 20]
    tokenizer = add_tool_template(build_tokenizer(corpus, vocab_size=512))
    tokenizer.save_pretrained(str(model_dir))
    # twice the own-model example's width: copying digits through two layers needs the room
    save_tiny_model(model_dir, tokenizer, seed=seed, dtype="float32", hidden_size=128, rope_theta=10000.0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    report = None
    if warm_start_steps > 0:
        every = max(1, warm_start_steps // 10)

        def progress(step: int, loss: float) -> None:
            if step % every == 0 or step == warm_start_steps:
                say(f"tool-use warm start: step {step}/{warm_start_steps} loss {loss:.4f}")

        report = warm_start(model_dir, tokenizer, end, warm_start_steps, seed=seed, direct_share=direct_share,
                            progress=progress)
        say(f"tool-use warm start done in {report.seconds:.0f} s: exact call turns {report.exact_calls:.0%} (after "
            f"<tool_call>), exact answer turns {report.exact_answers:.0%} (teacher-forced greedy, unseen problems); the first turn "
            f"calls the calculator with probability {report.call_probability:.2f}")
    path = out / "train.parquet"
    pq.write_table(pa.Table.from_pylist(data), str(path))
    return ToolUseExample(model_dir, path, report)
