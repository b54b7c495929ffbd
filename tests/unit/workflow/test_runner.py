"""The runner's duties whatever the workflow: one version for every call, an aborted call drops the
trajectory, the environment's crash re-runs the sample (a bug stops the run), the engine's faults
reach the runtime unchanged, malformed trajectories are refused naming the field."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dora_megatron.comm.engine_client import EngineError, VersionMismatch
from dora_megatron.data.tasks import Prompt
from dora_megatron.workflow.api import Trajectory, WorkflowContext
from dora_megatron.workflow.runner import (MAX_FAILURES, TrajectoryAborted, WorkflowFailed, WorkflowLoadError,
                                           WorkflowRunner, load_workflow, workflow_runner)

from tests.helpers.workflows import ENV, two_turns

from .conftest import ScriptedEngine

PROMPT = Prompt(0, "q", "a")


def run(runner, engine, version=3):
    return asyncio.run(runner.run(engine, PROMPT, [1, 5, 6], sample_id="g1.0", version=version,
                                  sampling={"max_new_tokens": 64, "sampling_seed": 5}))


def runner_of(fn):
    return WorkflowRunner(fn, WorkflowContext(None, (2,)))


def test_every_call_of_a_trajectory_carries_its_version_and_a_wrong_one_is_refused_by_the_engine():
    engine = ScriptedEngine([[7, 8, 2], [9, 2]], version=3)
    reply = run(runner_of(two_turns), engine)
    assert [c["version"] for c in engine.calls] == [3, 3]
    assert reply.output_ids == [7, 8, 2, 90, 91, 9, 2] and reply.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert reply.prompt_ids == [1, 5, 6] and reply.versions_used == ["3", "3"]
    with pytest.raises(VersionMismatch):  # the runtime re-queues it (the engine's C1 guard)
        run(runner_of(two_turns), ScriptedEngine([[7, 2]], version=4))


class AbortsSecond(ScriptedEngine):
    async def generate(self, input_ids, sampling_params=None, **kw):
        resp = await super().generate(input_ids, sampling_params, **kw)
        if len(self.calls) == 2:
            return SimpleNamespace(**{**vars(resp), "output_ids": resp.output_ids[:1],
                                      "output_token_logprobs": resp.output_token_logprobs[:1],
                                      "finish_reason": {"type": "abort"}})
        return resp


def test_an_aborted_turn_drops_the_whole_trajectory_even_if_the_workflow_swallows_it():
    runner = runner_of(two_turns)
    reply = run(runner, AbortsSecond([[7, 8, 2], [9, 2]]))
    assert reply.finish_reason == {"type": "abort"} and reply.output_ids == [] and reply.loss_mask is None

    async def swallows(prompt, prompt_ids, client, ctx):
        try:
            return await two_turns(prompt, prompt_ids, client, ctx)
        except Exception:  # noqa: BLE001 - a careless workflow: it goes on after the abort
            out = await client.generate(prompt_ids)
            return Trajectory(prompt_ids, out.output_ids, [1] * len(out.output_ids), out.logprobs)

    engine = AbortsSecond([[7, 8, 2], [9, 2]])
    reply = run(runner_of(swallows), engine)
    assert reply.finish_reason == {"type": "abort"} and reply.output_ids == []
    assert len(engine.calls) == 2  # the call after the abort never reached the engine
    assert runner.counts["env/trajectories_aborted"] == 1


class DroppedBetweenTurns:
    """A turn host whose trajectory is dropped while its next turn waits to be placed (moved or
    interrupted by the runtime between turns)."""

    async def keep_kv(self):
        return False

    async def ended(self):
        pass

    async def next(self):
        raise TrajectoryAborted("g1.0")

    def moving(self):
        return False


def test_a_trajectory_dropped_while_its_next_turn_waits_is_aborted_not_a_workflow_failure():
    runner = runner_of(two_turns)
    engine = ScriptedEngine([[7, 8, 2], [9, 2]], version=3)
    reply = asyncio.run(runner.run(engine, PROMPT, [1, 5, 6], sample_id="g1.0", version=3,
                                   sampling={"max_new_tokens": 64}, turns=DroppedBetweenTurns()))
    assert reply.finish_reason == {"type": "abort"} and reply.output_ids == [] and len(engine.calls) == 1
    assert runner.counts["env/trajectories_aborted"] == 1 and runner.counts["env/workflow_failures"] == 0


def test_a_crashed_environment_reruns_the_sample_and_a_workflow_that_always_fails_stops_the_run():
    crashes = {"n": 0}

    async def flaky(prompt, prompt_ids, client, ctx):
        await client.generate(prompt_ids)
        crashes["n"] += 1
        raise ConnectionResetError("sandbox went away") if crashes["n"] == 1 else RuntimeError("env crashed")

    runner = runner_of(flaky)
    errors = []
    for _ in range(MAX_FAILURES):
        with pytest.raises(WorkflowFailed) as info:
            run(runner, ScriptedEngine([[7, 2]]))
        errors.append(info.value)
    # the environment's own OSError is the workflow's failure, not the instance's
    assert "ConnectionResetError: sandbox went away" in str(errors[0])
    assert [e.final for e in errors] == [False] * (MAX_FAILURES - 1) + [True]
    assert runner.counts["env/workflow_failures"] == MAX_FAILURES


def test_an_engine_fault_reaches_the_runtime_unchanged_even_if_the_workflow_wraps_it():
    class Dead(ScriptedEngine):
        async def generate(self, *a, **kw):
            raise EngineError("dead", 503, "gone")

    async def wraps(prompt, prompt_ids, client, ctx):
        try:
            await client.generate(prompt_ids)
        except Exception as err:
            raise RuntimeError("my env saw an error") from err

    with pytest.raises(EngineError, match="503"):
        run(runner_of(wraps), Dead([[1]]))


@pytest.mark.parametrize("bad, match", [
    (lambda ids, out: Trajectory(ids, out, [1], [0.0] * len(out)), "loss_mask has 1"),
    (lambda ids, out: Trajectory(ids, out, [2] * len(out), [0.0] * len(out)), "loss_mask holds 2"),
    (lambda ids, out: Trajectory(ids, out, [0] * len(out), [0.0] * len(out)), "no model token"),
    (lambda ids, out: Trajectory(ids[:-1], out, [1] * len(out), [0.0] * len(out)), "context no engine call was sent"),
    (lambda ids, out: {"response_ids": out}, "not a Trajectory"),
])
def test_a_malformed_trajectory_is_refused_naming_what_is_wrong(bad, match):
    async def wf(prompt, prompt_ids, client, ctx):
        out = await client.generate(prompt_ids)
        return bad(prompt_ids, out.output_ids)

    with pytest.raises(WorkflowFailed, match=match):
        run(runner_of(wf), ScriptedEngine([[7, 8, 2]]))


def test_workflows_load_by_name_module_or_file(tmp_path):
    assert workflow_runner("", {}, None) is None  # the default: the runtime's own single turn
    assert load_workflow("single_turn").__name__ == "single_turn"
    assert load_workflow("tests.unit.workflow.test_runner:two_turns") is two_turns
    f = tmp_path / "mine.py"
    f.write_text("async def go(prompt, prompt_ids, client, ctx):\n    pass\n\ndef sync(a, b, c, d):\n    pass\n")
    assert load_workflow(f"{f}:go").__name__ == "go"
    with pytest.raises(WorkflowLoadError, match="not an async function"):
        load_workflow(f"{f}:sync")
    with pytest.raises(WorkflowLoadError, match=r"rollout.workflow: .*mine.py has no function 'nope' \(it has: go, sync\)"):
        load_workflow(f"{f}:nope")


def test_the_single_turn_workflow_is_one_generation():
    engine = ScriptedEngine([[7, 8, 2]])
    reply = run(workflow_runner("single_turn", {}, SimpleNamespace(eos_ids=[2])), engine)
    assert reply.output_ids == [7, 8, 2] and reply.loss_mask == [1, 1, 1] and len(engine.calls) == 1
    assert engine.calls[0]["input_ids"] == [1, 5, 6]


def test_a_trajectory_fits_the_trainer_sequence_even_when_the_workflow_renders_a_longer_prompt():
    """max_new_tokens 64 would allow 64 response tokens; trainer.max_seq_len 8 after a 3-token prompt
    leaves 5, so every call is cut to what is left of those 5."""
    engine = ScriptedEngine([[7, 8, 2], [9, 9, 9, 9, 2]], version=3)
    reply = asyncio.run(WorkflowRunner(two_turns, WorkflowContext(None, (2,)), max_seq_len=8).run(
        engine, PROMPT, [1, 5, 6], sample_id="g1.0", version=3, sampling={"max_new_tokens": 64}))
    assert engine.calls[0]["sampling"]["max_new_tokens"] == 5
    assert len(reply.prompt_ids) + len(reply.output_ids) <= 8
    with pytest.raises(WorkflowFailed, match=r"trainer\.max_seq_len=3"):
        asyncio.run(WorkflowRunner(two_turns, WorkflowContext(None, (2,)), max_seq_len=3).run(
            ScriptedEngine([[7, 2]]), PROMPT, [1, 5, 6], sample_id="g1.1", version=3, sampling={}))

