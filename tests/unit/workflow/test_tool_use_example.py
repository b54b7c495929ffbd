"""The tool-use example's warm start teaches exactly the trajectories the tool-calling workflow
builds: a teacher trace, replayed through the workflow by a scripted engine, is the same token ids."""

from __future__ import annotations

import asyncio
import json
import re

from dora_megatron.data.tasks import Prompt
from dora_megatron.models import tool_use_example as ex
from dora_megatron.workflow.api import WorkflowContext
from dora_megatron.workflow.runner import WorkflowRunner
from dora_megatron.workflow.tool_calling import tool_calling
from dora_megatron.workflow.tools import Calculator

from .conftest import ScriptedEngine


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
