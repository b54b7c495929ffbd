"""The tool-calling workflow on a Qwen3-style chat template, run by the runner against a scripted
engine: token in, token out across turns, the loss mask, tool faults counted, pinning, budgets."""

from __future__ import annotations

import asyncio

import pytest

from dora_megatron.data.tasks import Prompt
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.workflow.api import Trajectory, WorkflowContext
from dora_megatron.workflow.runner import WorkflowFailed, WorkflowLoadError, WorkflowRunner, workflow_runner
from dora_megatron.workflow.tool_calling import tool_calling

from .conftest import ScriptedEngine

PROMPT = Prompt(0, "", "51", messages=({"role": "system", "content": "Use the tools."},
                                       {"role": "user", "content": "What is 17 * 3?"}))
SAMPLING = {"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": 11}


def turn(codec, text: str) -> list[int]:
    """A model turn as an engine generates it: the text's tokens, then the end-of-turn token."""
    return codec.tokenizer.encode(text, add_special_tokens=False) + [codec.eos_ids[0]]


def call(expression: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression


def run(runner, engine, version=3, prompt=PROMPT, sampling=SAMPLING):
    return asyncio.run(runner.run(engine, prompt, [1, 2, 3], sample_id="g0.0", version=version, sampling=sampling))


def test_a_tool_call_turn_then_an_answer_is_one_token_exact_trajectory(tool_codec):
    tk = tool_codec.tokenizer
    first, second = turn(tool_codec, call("17 * 3")), turn(tool_codec, "The answer is \\boxed{51}.")
    engine = ScriptedEngine([first, second])
    runner = workflow_runner("tool_calling", {"tools": ["calculator"]}, tool_codec)
    reply = run(runner, engine)
    start = engine.calls[0]["input_ids"]
    assert "<tools>" in tk.decode(start) and "calculator" in tk.decode(start)  # rendered with tools=
    env = reply.output_ids[len(first):len(reply.output_ids) - len(second)]
    assert reply.output_ids == first + env + second
    assert tk.decode(env).strip().startswith("<|im_start|>user\n<tool_response>\n51\n</tool_response>")
    # the second turn was generated from exactly the trajectory so far: no text round trip
    assert engine.calls[1]["input_ids"] == start + first + env
    assert reply.prompt_ids == start
    assert reply.loss_mask == [1] * len(first) + [0] * len(env) + [1] * len(second)
    lp = [-(i + 1) / 100 for i in range(len(first))] + [0.0] * len(env) + [-(i + 1) / 100 for i in range(len(second))]
    assert reply.output_token_logprobs == lp
    assert {c["version"] for c in engine.calls} == {3} and {c["rid"] for c in engine.calls} == {"g0.0"}
    assert len({c["sampling"]["sampling_seed"] for c in engine.calls}) == 2  # each turn samples anew
    assert reply.turns == 2 and reply.metrics["env/tool_calls"] == 1 and reply.metrics["env/tool_errors"] == 0
    assert reply.metrics["env/tool_calls_well_formed"] == 1
    # what the runtime tells the recorder of it (turns, the model's tokens, one well-formed call)
    stats = TrajectoryStats.of(reply.turns, sum(reply.loss_mask), reply.metrics)
    assert (stats.turns, stats.model_tokens, stats.tool_calls, stats.well_formed_calls) == (2, len(first + second), 1, 1)
    assert runner.counts["env/trajectories"] == 1 and runner.counts["env/turns"] == 2


def test_model_tokens_that_do_not_survive_a_text_round_trip_are_kept_as_generated(tool_codec):
    """Token in, token out: the engine may emit a tokenization the tokenizer would not produce
    (here one token per character); the workflow keeps those ids, and a workflow that decodes and
    encodes a turn again is refused before its tokens reach the trainer."""
    tk = tool_codec.tokenizer
    text = "The answer is 51."
    odd = [tk.convert_tokens_to_ids(ch if ch != " " else "Ġ") for ch in text] + [tool_codec.eos_ids[0]]
    assert tk.encode(tk.decode(odd, skip_special_tokens=False), add_special_tokens=False) != odd  # drift exists
    reply = run(workflow_runner("tool_calling", {}, tool_codec), ScriptedEngine([odd]))
    assert reply.output_ids == odd and reply.loss_mask == [1] * len(odd)

    async def round_trip(prompt, prompt_ids, client, ctx):
        out = await client.generate(prompt_ids)
        again = ctx.tokenizer.encode(ctx.tokenizer.decode(out.output_ids, skip_special_tokens=False),
                                     add_special_tokens=False)
        return Trajectory(prompt_ids, again, [1] * len(again), [0.0] * len(again))

    runner = WorkflowRunner(round_trip, WorkflowContext(tk, tuple(tool_codec.eos_ids)))
    with pytest.raises(WorkflowFailed, match="differ from what the engine generated"):
        run(runner, ScriptedEngine([odd]))


def test_tool_faults_are_shown_to_the_model_and_counted(tool_codec):
    tk = tool_codec.tokenizer
    hang = '<tool_call>\n{"name": "python", "arguments": {"code": "while True: pass"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 +"}}\n</tool_call>'
    broken = "<tool_call>\n{not json}\n</tool_call>"
    first = turn(tool_codec, hang + bad + broken)
    engine = ScriptedEngine([first, turn(tool_codec, "I cannot tell.")])
    runner = workflow_runner("tool_calling", {"tool_timeout_s": 0.5}, tool_codec)
    reply = run(runner, engine, sampling={**SAMPLING, "max_new_tokens": 4000})
    env = tk.decode(engine.calls[1]["input_ids"][len(engine.calls[0]["input_ids"]) + len(first):])
    assert env.count("<tool_response>") == 3
    assert "did not finish within 0.5 s" in env and "not an arithmetic expression" in env and "not valid JSON" in env
    latency = reply.metrics.pop("env/tool_latency_s")
    assert reply.metrics == {"env/tool_calls": 3, "env/tool_calls_well_formed": 2, "env/tool_errors": 3,
                             "env/tool_timeouts": 1}
    assert latency >= 0.5  # the hung call was waited for up to its limit; the malformed one never ran
    assert runner.counts["env/tool_timeouts"] == 1 and runner.counts["env/tool_errors"] == 3


def test_turns_end_at_max_turns_and_the_response_at_max_new_tokens(tool_codec):
    always = turn(tool_codec, call("1 + 1"))
    engine = ScriptedEngine([always])
    reply = run(workflow_runner("tool_calling", {"max_turns": 3}, tool_codec), engine)
    assert len(engine.calls) == 3 and reply.turns == 3
    assert reply.output_ids[-len(always):] == always  # the last turn's calls are not run
    # a response budget smaller than two turns: the second call may only generate what is left
    budget = len(always) + 5
    engine = ScriptedEngine([always])
    reply = run(workflow_runner("tool_calling", {"max_turns": 5}, tool_codec), engine,
                sampling={**SAMPLING, "max_new_tokens": budget})
    assert len(reply.output_ids) <= budget and reply.finish_reason == {"type": "length"}
    assert all(c["sampling"]["max_new_tokens"] <= budget for c in engine.calls)
    assert sum(reply.loss_mask) == len(always)  # the environment tokens past the budget were cut


def test_a_preset_vocabulary_without_a_template_is_refused_naming_the_key_when_the_job_is_built():
    from dora_megatron.data.codec import CharCodec

    with pytest.raises(WorkflowLoadError, match="model.path"):
        workflow_runner("tool_calling", {}, CharCodec())


def test_options_it_cannot_run_with_are_refused_naming_them_when_the_job_is_built(tool_codec):
    """Before any process starts, not once per trajectory (every sample would fail first)."""
    with pytest.raises(WorkflowLoadError, match="unknown key.*max_turn"):
        workflow_runner("tool_calling", {"max_turn": 2}, tool_codec)
    with pytest.raises(WorkflowLoadError, match="web_search"):
        workflow_runner("tool_calling", {"tools": ["web_search"]}, tool_codec)
    assert workflow_runner("tool_calling", {"max_turns": 2}, tool_codec) is not None
