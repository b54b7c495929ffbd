"""A two-turn workflow on the runtime's fake engines (model turn, ``ENV`` from the environment, model
turn) and the checks of its trajectories, shared by the runtime's workflow tests."""

from __future__ import annotations

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import running_sum_reward
from dora_megatron.workflow.api import Trajectory, WorkflowContext
from dora_megatron.workflow.runner import WorkflowRunner
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers.runtime import make

ENV = tok.encode("|")  # what the test environment answers after the model's first turn


async def answer_then_env(prompt, prompt_ids, client, ctx):
    """The model answers, the environment writes ENV, the model is asked to go on (the fake
    engine's answer is complete: it adds nothing)."""
    first = await client.generate(prompt_ids)
    second = await client.generate(prompt_ids + first.output_ids + ENV)
    ids = first.output_ids + ENV + second.output_ids
    mask = [1] * len(first.output_ids) + [0] * len(ENV) + [1] * len(second.output_ids)
    return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(ENV) + second.logprobs, turns=2)


def make_with_workflow(fn=answer_then_env, maker=make, **kw):
    """``maker(**kw)`` (:func:`~tests.helpers.runtime.make` or a test's own) with ``fn`` as its
    ``rollout.workflow``; returns the runtime, its engines and trainer, and every response text the
    reward was asked about."""
    seen: list[str] = []

    def reward(response: str, answer: str) -> float:
        seen.append(response)
        return running_sum_reward(response, answer)

    rt, engines, trainer = maker(workflow=WorkflowRunner(fn, WorkflowContext(None, (tok.EOS_ID,))), **kw)
    rt.store.reward_fn = ThreadScorer(reward).score_sync
    return rt, engines, trainer, seen


def check_trajectories(trainer, seen):
    for batch in trainer.batches:
        for s in batch:
            n = len(s.response_ids) - len(ENV)
            assert list(s.response_ids)[n:] == ENV and s.loss_mask == [1] * n + [0] * len(ENV)
            assert list(s.rollout_logprobs)[n:] == [0.0] * len(ENV)
    assert seen and not any("|" in text for text in seen)  # the reward never saw the environment's tokens
