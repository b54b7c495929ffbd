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


async def two_turns_with_tool(prompt, prompt_ids, client, ctx):
    """:func:`two_turns` with a tool between the turns that lasts ``tool_s`` seconds
    (``rollout.workflow_kwargs``); with ``log`` (a file path) it appends ``turn <sample id>`` when
    the first turn returned and ``done <sample id>`` when the trajectory is complete, so a test
    can show a kill landed between turns."""
    import asyncio

    log = ctx.options.get("log")

    def note(what: str) -> None:
        if log:
            with open(log, "a") as f:
                f.write(f"{what} {client.sample_id}\n")

    first = await client.generate(prompt_ids)
    note("turn")
    await asyncio.sleep(float(ctx.options.get("tool_s", 0.0)))
    second = await client.generate(prompt_ids + first.output_ids + ENV)
    ids = first.output_ids + ENV + second.output_ids
    mask = [1] * len(first.output_ids) + [0] * len(ENV) + [1] * len(second.output_ids)
    note("done")
    return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(ENV) + second.logprobs, turns=2)
