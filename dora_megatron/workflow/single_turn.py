"""The default workflow: one generation from the prompt, the reward left to ``data.reward_fn``.

WHY it exists although the runtime's own submit path does the same: a user's workflow starts from
it, and the runner's tests run it against the same engines as the single-turn path.
"""

from __future__ import annotations

from typing import Any

from dora_megatron.workflow.api import PinnedClient, Trajectory, WorkflowContext


async def single_turn(prompt: Any, prompt_ids: list[int], client: PinnedClient, ctx: WorkflowContext) -> Trajectory:
    out = await client.generate(prompt_ids)
    return Trajectory(list(prompt_ids), list(out.output_ids), [1] * len(out.output_ids), list(out.logprobs),
                      finish_reason=out.finish_reason)
