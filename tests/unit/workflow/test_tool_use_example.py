"""The tool-use example's warm start teaches exactly the trajectories the tool-calling workflow
builds: a teacher trace (a calculator call, or a direct answer), replayed through the workflow by a
scripted engine, is the same token ids; the example's reward pays the right product only."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from dora_megatron.data.tasks import Prompt
from dora_megatron.models import tool_use_example as ex
from dora_megatron.workflow.api import WorkflowContext
from dora_megatron.workflow.runner import WorkflowRunner
from dora_megatron.workflow.tool_calling import tool_calling
from dora_megatron.workflow.tools import Calculator

from .conftest import ScriptedEngine

ROOT = Path(__file__).resolve().parents[3]


def _tokenizer():
    from dora_megatron.models.example import build_tokenizer

    fixed = ex.TOOL_TEMPLATE + json.dumps(Calculator.schema) + ex.SYSTEM_PROMPT
    return ex.add_tool_template(build_tokenizer([re.sub(r"[0-9]+", " ", fixed)] * 5, vocab_size=320))


def test_a_teacher_trace_is_what_the_workflow_builds_from_the_same_turns():
    tk = _tokenizer()
    eos = tk.convert_tokens_to_ids("<|im_end|>")
    a, b = 31337, 27182
    t = ex.trace(tk, eos, a, b)
    turns = [ids for ids in _model_turns(t)]
    engine = ScriptedEngine(turns)
    runner = WorkflowRunner(tool_calling, WorkflowContext(tk, (eos,), {"tools": ["calculator"], "max_turns": 2}))
    row = ex.rows(1)[0]
    prompt = Prompt(0, "", row["reward_model"]["ground_truth"], messages=tuple(ex.messages(a, b)))
    reply = asyncio.run(runner.run(engine, prompt, [1], sample_id="g0.0", version=3,
                                   sampling={"max_new_tokens": 200}))
    assert reply.prompt_ids + reply.output_ids == t.ids  # the calculator's answer rendered as the trace has it
    assert reply.loss_mask == t.labels[len(reply.prompt_ids):]
    assert "<tool_response>\n%d\n" % (a * b) in tk.decode(t.ids)
    assert reply.metrics["env/tool_calls_well_formed"] == 1 and reply.metrics["env/tool_errors"] == 0


def _model_turns(t):
    out, cur = [], []
    for i, m in zip(t.ids, t.labels):
        if m:
            cur.append(i)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def test_every_digit_is_its_own_token_and_rows_carry_the_product():
    tk = _tokenizer()
    ids = tk.encode(ex.answer_text(9876543210), add_special_tokens=False)
    assert [tk.decode([i]) for i in ids if tk.decode([i]).isdigit()] == list("9876543210")
    for row in ex.rows(20, seed=3):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert len(str(a)) == len(str(b)) == ex.DIGITS and row["reward_model"]["ground_truth"] == str(a * b)


def test_a_direct_answer_is_one_turn_of_the_workflow_and_scores_zero():
    """The warm start's direct answers are trajectories the workflow builds when the model writes no
    call, and the example's reward gives them nothing: only the right product pays, never the call."""
    from dora_megatron.data.rewards import load_reward_function

    tk = _tokenizer()
    eos = tk.convert_tokens_to_ids("<|im_end|>")
    a, b = 31337, 27182
    d = ex.direct_trace(tk, eos, a, b)
    start = d.labels.index(1)  # the loss covers the decision (the first token) only
    assert sum(d.labels) == 1 and tk.decode(d.ids[start:]).startswith("The answer is")
    engine = ScriptedEngine([d.ids[start:]])
    runner = WorkflowRunner(tool_calling, WorkflowContext(tk, (eos,), {"tools": ["calculator"], "max_turns": 2}))
    prompt = Prompt(0, "", str(a * b), messages=tuple(ex.messages(a, b)))
    reply = asyncio.run(runner.run(engine, prompt, [1], sample_id="g0.0", version=3,
                                   sampling={"max_new_tokens": 200}))
    assert reply.prompt_ids + reply.output_ids == d.ids and len(engine.calls) == 1
    assert reply.metrics["env/tool_calls"] == 0
    score = load_reward_function(str(ROOT / "examples" / "tool_use" / "reward.py") + ":compute_score")
    model_text = tk.decode(reply.output_ids, skip_special_tokens=True)
    assert score(ex.DATA_SOURCE, model_text, str(a * b))["score"] == 0.0
    # a call followed by a wrong answer earns nothing either; the right product does, called or not
    wrong = ex.call_text(a, b) + ex.answer_text(a * b + 1)
    assert score(ex.DATA_SOURCE, wrong, str(a * b)) == {"score": 0.0, "called": 1.0, "boxed": 1.0}
    assert score(ex.DATA_SOURCE, ex.answer_text(a * b), str(a * b))["score"] == 1.0


def test_direct_answers_make_their_share_of_a_warm_start_batch():
    for share in (0.3, 0.7, 0.8):
        n = ex.direct_count(16, share)
        assert abs(n / (16 + n) - share) < 0.02
    assert ex.direct_count(16, 0.0) == 0
    with pytest.raises(ValueError, match="direct_share"):
        ex.direct_count(16, 1.0)
