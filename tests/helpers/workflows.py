"""A two-turn test workflow (model turn, environment tokens, model turn), loadable as
``rollout.workflow: tests.helpers.workflows:two_turns``."""

from __future__ import annotations

from dora_megatron.workflow.api import Trajectory

ENV = [90, 91]  # tokens the test environment writes between turns


async def two_turns(prompt, prompt_ids, client, ctx):
    first = await client.generate(prompt_ids)
    second = await client.generate(prompt_ids + first.output_ids + ENV)
    ids = first.output_ids + ENV + second.output_ids
    mask = [1] * len(first.output_ids) + [0] * len(ENV) + [1] * len(second.output_ids)
    return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(ENV) + second.logprobs, turns=2)
