"""A tool-using workflow in Qwen3's format: the model writes ``<tool_call>`` blocks, the tools run,
their results are appended as the chat template renders a ``tool`` message, the model goes on.

Token in, token out: every token of the trajectory is either one the engine generated (kept as
generated, mask 1) or one the chat template wrote for the environment (mask 0). The environment's
tokens are what :func:`env_tokens` finds the template writes between an assistant's end-of-turn
token and the next generation prompt; the model's turns are never decoded and encoded again.
The model's text is decoded only to find its tool calls.

Options (``rollout.workflow_kwargs``): ``tools`` (names of :data:`~.tools.EXAMPLE_TOOLS`, default
both), ``max_turns`` (model turns, default 4), ``tool_timeout_s`` (default 10), ``python_timeout_s``,
``python_memory_mb``, ``max_tool_chars`` (a result is cut beyond it, default 2000).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dora_megatron.workflow.api import PinnedClient, Trajectory, WorkflowContext
from dora_megatron.workflow.tools import Tool, call_tool, make_tools, parse_tool_calls

log = logging.getLogger(__name__)

#: the chat a tool message is rendered after by :func:`env_tokens` (only its tail is kept)
_ANCHOR = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "."})


@dataclass(frozen=True)
class ToolOptions:
    tools: tuple[str, ...] = ("calculator", "python")
    max_turns: int = 4
    tool_timeout_s: float = 10.0
    max_tool_chars: int = 2000

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ToolOptions":
        known = {"tools", "max_turns", "tool_timeout_s", "max_tool_chars", "python_timeout_s", "python_memory_mb"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"rollout.workflow_kwargs: unknown key(s) {', '.join(unknown)} of the tool-calling "
                             f"workflow (known: {', '.join(sorted(known))})")
        out = cls(tuple(options.get("tools", cls.tools)), int(options.get("max_turns", cls.max_turns)),
                  float(options.get("tool_timeout_s", cls.tool_timeout_s)),
                  int(options.get("max_tool_chars", cls.max_tool_chars)))
        if out.max_turns < 1:
            raise ValueError(f"rollout.workflow_kwargs.max_turns: {out.max_turns} (must be >= 1)")
        return out


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool,
           tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's own chat template (transformers renders it)."""
    ids = tokenizer.apply_chat_template([dict(m) for m in messages], tools=list(tools) if tools else None,
                                        add_generation_prompt=generation_prompt, tokenize=True, return_dict=False,
                                        **kwargs)
    return [int(i) for i in ids]


def env_tokens(tokenizer: Any, tool_messages: Sequence[Mapping[str, Any]], eos_ids: Sequence[int],
               **kwargs: Any) -> list[int]:
    """The tokens the chat template writes after an assistant turn's end-of-turn token (one of
    ``eos_ids``) for ``tool_messages``, up to and including the next assistant generation prompt.

    Found as the difference of two renderings of a fixed chat, so no template is written here.
    Raises ValueError when the template renders earlier turns differently once a tool message
    follows (no token-exact continuation exists then) or ends an assistant turn with no EOS."""
    base = render(tokenizer, _ANCHOR, generation_prompt=False, **kwargs)
    full = render(tokenizer, [*_ANCHOR, *tool_messages], generation_prompt=True, **kwargs)
    if full[:len(base)] != base:
        raise ValueError("the chat template renders the earlier turns differently once a tool message follows; "
                         "a tool result cannot be appended token-exactly")
    ends = [i for i, t in enumerate(base) if t in set(eos_ids)]
    if not ends:
        raise ValueError("the chat template ends an assistant turn with none of the EOS ids "
                         f"{list(eos_ids)}; cannot tell where the model's turn ends")
    return base[ends[-1] + 1:] + full[len(base):]


async def tool_calling(prompt: Any, prompt_ids: list[int], client: PinnedClient, ctx: WorkflowContext) -> Trajectory:
    """Up to ``max_turns`` model turns; a turn that ends with its EOS and calls tools is followed by
    their results, any other turn ends the trajectory. The reward is left to ``data.reward_fn``."""
    opts, tools = _setup(ctx.options, ctx)
    kwargs = dict(ctx.chat_template_kwargs)
    messages = list(prompt.messages) or [{"role": "user", "content": prompt.text}]
    # the prompt is rendered again with the tools' schemas (the codec's rendering has none)
    start = render(ctx.tokenizer, messages, generation_prompt=True, tools=[t.schema for t in tools.values()],
                   **kwargs)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    metrics = {"env/tool_calls": 0.0, "env/tool_calls_well_formed": 0.0, "env/tool_errors": 0.0,
               "env/tool_timeouts": 0.0, "env/tool_latency_s": 0.0}
    finish, turns = None, 0
    for turns in range(1, opts.max_turns + 1):
        out = await client.generate(start + response)
        response += out.output_ids
        mask += [1] * len(out.output_ids)
        logprobs += out.logprobs
        finish = out.finish_reason
        ended = bool(out.output_ids) and out.output_ids[-1] in ctx.eos_ids
        calls = parse_tool_calls(ctx.tokenizer.decode(out.output_ids, skip_special_tokens=True)) if ended else []
        if not calls or turns == opts.max_turns:
            break
        results = []
        for call in calls:
            if isinstance(call, str):  # malformed: the parse error is the result
                result_text, error, timed_out = call, True, False
            else:
                t0 = time.monotonic()
                res = await call_tool(tools, call[0], call[1], opts.tool_timeout_s, opts.max_tool_chars)
                metrics["env/tool_latency_s"] += time.monotonic() - t0
                metrics["env/tool_calls_well_formed"] += 1
                result_text, error, timed_out = res.content, res.error, res.timed_out
            metrics["env/tool_calls"] += 1
            metrics["env/tool_errors"] += error
            metrics["env/tool_timeouts"] += timed_out
            results.append({"role": "tool", "content": result_text})
        env = env_tokens(ctx.tokenizer, results, ctx.eos_ids, **kwargs)
        response += env
        mask += [0] * len(env)
        logprobs += [0.0] * len(env)
    return Trajectory(start, response, mask, logprobs, finish_reason=finish, turns=turns, metrics=metrics)


def _setup(options: Mapping[str, Any], ctx: WorkflowContext) -> tuple[ToolOptions, dict[str, Tool]]:
    """The options and tools of a run, or ValueError naming what cannot act."""
    if ctx.tokenizer is None:
        raise ValueError("rollout.workflow: the tool-calling workflow needs a model directory with a chat "
                         "template (model.path), not the preset character vocabulary")
    opts = ToolOptions.from_options(options)
    return opts, make_tools(opts.tools, options)


def check_options(options: Mapping[str, Any], ctx: WorkflowContext) -> None:
    """Called when the job is built (:func:`~dora_megatron.workflow.runner.workflow_runner`)."""
    _setup(options, ctx)


tool_calling.check_options = check_options  # type: ignore[attr-defined]
