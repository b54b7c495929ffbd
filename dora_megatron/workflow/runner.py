"""Runs a sample's workflow, pinned to the sample's weight version (its turns where the orchestrator puts them).

WHY the runtime sees a workflow as one engine answer: the orchestrator's unit of work is a sample
submitted on an instance for a version. A whole trajectory (every turn, every tool call) is one
sample, and every engine call carries the sample's version (the engine's C1 guard refuses any
other), so C1 holds per trajectory by construction. The runner hands the runtime a
:class:`WorkflowReply` shaped like the engine's answer.

Between turns the trajectory is off the engine (:class:`TurnHost`): when a turn's ``generate``
returns, the runtime is told (the orchestrator frees the slot while the tool runs), and the next
turn waits until the orchestrator places it again, on an instance of the same version (the one of
the last turn, or another). A turn moved while it generates answers from the instance it was
moved to (:meth:`TurnHost.moved`): the workflow never sees the move. In ``partial`` mode a trajectory
placed on newer weights runs again from its prompt on them (it never mixes versions).

What happens to a trajectory that cannot finish:

* an engine call is aborted (the orchestrator interrupts the sample, or moves it to another
  instance where its KV cannot go, by abort + resubmit): the trajectory so far is dropped and the reply says ``abort``;
  the resubmission runs the workflow again from the prompt with the same version. Nothing of a
  half trajectory is kept, so nothing is duplicated.
* an engine call fails (the instance died): the error goes to the runtime, which fails the
  instance; the orchestrator re-queues the sample and it runs again, elsewhere.
* the workflow raises (its environment crashed) or returns a malformed trajectory:
  :class:`WorkflowFailed`; the runtime re-queues the sample (counted, ``env/workflow_failures``).
"""

from __future__ import annotations

import logging
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from dora_megatron.workflow.api import Generation, Trajectory, WorkflowContext

log = logging.getLogger(__name__)

#: the default ``rollout.workflow``: today's single turn, run by the runtime itself (no runner)
SINGLE_TURN = ""
#: the built-in workflows by short name
BUILT_IN = {"single_turn": "dora_megatron.workflow.single_turn:single_turn",
            "tool_calling": "dora_megatron.workflow.tool_calling:tool_calling"}


class WorkflowLoadError(ValueError):
    """``rollout.workflow`` cannot be loaded."""


class WorkflowFailed(RuntimeError):
    """The workflow raised or returned a malformed trajectory: the sample is run again, unless
    ``final`` (it failed :data:`MAX_FAILURES` times in a row: a bug, not a crash; the run stops)."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


#: failures in a row of one sample's workflow after which the run stops with the last one's cause
MAX_FAILURES = 3


class TurnHost(Protocol):
    """Where a trajectory's turns run (the runtime): the first turn on the engine the sample was
    submitted to; later ones wherever the orchestrator places them."""

    async def ended(self) -> None:
        """A turn's ``generate`` returned: the trajectory leaves its engine while the workflow works.
        Raises :class:`TrajectoryAborted` if the trajectory was moved or interrupted meanwhile."""

    async def next(self) -> tuple[Any, int]:
        """Wait until the next turn is placed: the engine it runs on and the version it runs with."""

    async def keep_kv(self) -> bool:
        """Whether the turn about to be sent asks its engine to keep its KV when it finishes (for
        the next turn, on that instance or carried to another)."""

    def moving(self) -> bool:
        """Whether the turn's request was exported to another instance and that instance's answer
        is still to be taken (:meth:`moved`)."""

    async def moved(self) -> tuple[Any, Any]:
        """The turn's request was moved to another instance while it generated (the engine's
        answer said ``migrated``): wait for that instance's answer; returns its engine and the
        answer. Raises :class:`TrajectoryAborted` if the move failed."""


class TrajectoryAborted(Exception):
    """An engine call of the trajectory was aborted: the trajectory is dropped (raised through the
    workflow's own code; a workflow must not swallow it)."""


def load_workflow(spec: str) -> Callable[..., Any]:
    """The workflow ``spec`` names: a built-in's short name, ``package.module:function`` or
    ``path/to/file.py:function``; it must be an ``async`` function."""
    import inspect

    from dora_megatron.data.named import load_named_function

    fn = load_named_function(BUILT_IN.get(spec, spec), "rollout.workflow", WorkflowLoadError)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise WorkflowLoadError(f"rollout.workflow: {spec} is not an async function "
                                "(async def workflow(prompt, prompt_ids, client, ctx) -> Trajectory)")
    return fn


@dataclass
class _Call:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


class PinnedEngineClient:
    """:class:`~dora_megatron.workflow.api.PinnedClient` over one engine for one sample: every call
    has the sample's rid and ``version``; each call gets its own sampling seed (derived from the
    submission's seed and the call's index, so a re-run trajectory samples anew).

    The submission's ``max_new_tokens`` bounds the whole response (everything after the first
    call's input), so a trajectory fits the trainer's sequence like a single turn: each call may
    generate at most what is left, and a call with nothing left answers no tokens, ``length``."""

    def __init__(self, engine: Any, sample_id: str, version: int, sampling: Mapping[str, Any], *,
                 routed_experts: bool = False, max_seq_len: int | None = None,
                 turns: TurnHost | None = None) -> None:
        self.engine = engine
        self.turns = turns
        self.on_engine = True  # the sample was submitted: its first turn has its slot
        self.retag: int | None = None  # placed on another version between turns: run again with it
        self.sample_id = sample_id
        self.version = version
        self.sampling = dict(sampling)
        self.routed_experts = routed_experts
        self.calls: list[_Call] = []
        self.versions_used: list[str] = []
        self.last_raw: dict[str, Any] = {}
        self.engine_error: BaseException | None = None
        self.aborted = False
        self.budget = int(self.sampling.get("max_new_tokens", 1 << 30))
        self.max_seq_len = max_seq_len  # trainer.max_seq_len: the prompt plus the whole response fit in it
        self.base: int | None = None  # the first call's input length (the trajectory's prompt)

    async def generate(self, token_ids: Sequence[int], sampling: Mapping[str, Any] | None = None) -> Generation:
        if self.aborted:  # the workflow went on after an abort it caught: the trajectory is dropped anyway
            raise TrajectoryAborted(self.sample_id)
        params = {**self.sampling, **(sampling or {})}
        ids = [int(t) for t in token_ids]
        if self.base is None:
            self.base = len(ids)
            if self.max_seq_len is not None:
                # a workflow may render a longer prompt than the one the data filter checked (a tool
                # schema): the response shrinks so the trajectory still fits the trainer's sequence
                if self.base >= self.max_seq_len:
                    raise ValueError(f"the trajectory's prompt is {self.base} tokens, which leaves no room in "
                                     f"trainer.max_seq_len={self.max_seq_len}")
                self.budget = min(self.budget, self.max_seq_len - self.base)
        left = self.budget - (len(ids) - self.base)
        if left <= 0:
            return Generation([], [], "length")
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", left)), left)
        seed = int(self.sampling.get("sampling_seed", 0))
        params["sampling_seed"] = zlib.crc32(f"{seed}/{len(self.calls)}".encode()) & 0x7FFFFFFF
        if not self.on_engine:  # a later turn: the orchestrator places it (maybe on another instance)
            self.engine, version = await self.turns.next()  # type: ignore[union-attr]
            self.on_engine = True
            if version != self.version:  # partial mode re-tagged it: the whole trajectory runs again
                self.aborted, self.retag = True, version
                raise TrajectoryAborted(self.sample_id)
        try:
            extra = {"routed_experts": True} if self.routed_experts else {}
            if self.turns is not None and await self.turns.keep_kv():
                extra["keep_kv"] = True  # its KV stays on the engine for the next turn
            try:
                resp = await self.engine.generate(ids, params, rid=self.sample_id, return_logprob=True,
                                                  version=self.version, **extra)
            except Exception:
                if self.turns is None or not self.turns.moving():
                    raise
                resp = None  # the source failed after it let the turn go: its answer comes from where it went
            while resp is None or (getattr(resp, "migrated", False) and self.turns is not None):
                # moved to another instance of the version mid-turn: its answer comes from there
                self.versions_used += [str(v) for v in getattr(resp, "versions_used", ())]
                self.engine, resp = await self.turns.moved()  # type: ignore[union-attr]
        except TrajectoryAborted:
            self.aborted = True
            raise
        except Exception as err:
            self.engine_error = err  # the engine's fault, whatever the workflow makes of it
            raise
        self.versions_used += [str(v) for v in getattr(resp, "versions_used", ())]
        reason = (resp.finish_reason or {}).get("type")
        if reason == "abort":
            self.aborted = True
            raise TrajectoryAborted(self.sample_id)
        out = list(resp.output_ids)
        lps = list(resp.output_token_logprobs or [0.0] * len(out))
        self.calls.append(_Call(ids, out, lps))
        self.last_raw = getattr(resp, "raw", None) or {}
        if self.turns is not None:
            self.on_engine = False
            try:
                await self.turns.ended()
            except TrajectoryAborted:
                self.aborted = True
                raise
        return Generation(out, lps, reason)


def check_token_in_token_out(traj: Trajectory, calls: Sequence[_Call]) -> list[float]:
    """Check every run of model tokens (mask 1) of ``traj`` is, token for token, the start of what
    one engine call generated from exactly the trajectory's tokens before it; return the engine's
    log-probs of the response (0.0 on environment tokens). Raises ValueError naming the first
    position where a re-tokenized or edited model turn would have entered the loss."""
    full = traj.prompt_ids + traj.response_ids
    p0 = len(traj.prompt_ids)
    by_input: dict[tuple[int, ...], _Call] = {tuple(c.input_ids): c for c in calls}
    out = [0.0] * len(traj.response_ids)
    i = 0
    while i < len(traj.response_ids):
        if not traj.loss_mask[i]:
            i += 1
            continue
        j = i
        while j < len(traj.response_ids) and traj.loss_mask[j]:
            j += 1
        call = by_input.get(tuple(full[:p0 + i]))
        if call is None:
            raise ValueError(f"trajectory: the model tokens at response position {i} follow a context no engine "
                             "call was sent (the context was re-tokenized or edited after generation)")
        run = traj.response_ids[i:j]
        if call.output_ids[:len(run)] != run:
            raise ValueError(f"trajectory: the model tokens at response position {i} differ from what the engine "
                             "generated there (decoded and encoded again?)")
        out[i:j] = call.logprobs[:len(run)]
        i = j
    return out


def _within(traj: Trajectory, budget: int) -> Trajectory:
    """``traj`` with its response cut to ``budget`` tokens (the tool result appended after the last
    turn may pass it; a prefix stays token-exact)."""
    if len(traj.response_ids) <= budget:
        return traj
    cut = Trajectory(traj.prompt_ids, traj.response_ids[:budget], traj.loss_mask[:budget], traj.logprobs[:budget],
                     traj.reward, "length", traj.turns, traj.metrics)
    cut.check()
    return cut


@dataclass
class WorkflowReply:
    """A finished (or aborted) trajectory in the shape of the engine's answer the runtime absorbs,
    plus its ``loss_mask``, ``reward``, and the ``prompt_ids`` it was generated from (a workflow
    may render the prompt its own way, e.g. with the tools' schemas)."""

    output_ids: list[int]
    output_token_logprobs: list[float]
    finish_reason: dict[str, Any]
    versions_used: list[str]
    prompt_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    reward: float | None = None
    turns: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    migrated: bool = False
    #: never pre-packed (the engine's ``GenerateResponse`` may be): the sample store converts the
    #: lists (:class:`~dora_megatron.events.answer.EngineAnswer` names what both carry)
    token_arrays: tuple[array[int], array[float]] | None = None


class WorkflowRunner:
    """Runs ``workflow`` for samples; counts what the trajectories report (``env/...``)."""

    def __init__(self, workflow: Callable[..., Any], ctx: WorkflowContext, max_seq_len: int | None = None) -> None:
        self.workflow = workflow
        self.ctx = ctx
        self.max_seq_len = max_seq_len
        self.failures: dict[str, int] = {}  # sample id -> failures in a row (gone once it succeeds)
        self.counts: dict[str, float] = {"env/trajectories": 0.0, "env/turns": 0.0, "env/workflow_failures": 0.0,
                                         "env/trajectories_aborted": 0.0}

    def _failed(self, sample_id: str, why: str) -> WorkflowFailed:
        self.counts["env/workflow_failures"] += 1
        n = self.failures[sample_id] = self.failures.get(sample_id, 0) + 1
        if n < MAX_FAILURES:
            log.warning("workflow of %s failed (%d of %d tries; run again): %s", sample_id, n, MAX_FAILURES, why)
        return WorkflowFailed(f"rollout.workflow failed on sample {sample_id} ({n} times in a row): {why}",
                              final=n >= MAX_FAILURES)

    async def run(self, engine: Any, prompt: Any, prompt_ids: list[int], *, sample_id: str, version: int,
                  sampling: Mapping[str, Any], routed_experts: bool = False,
                  turns: TurnHost | None = None) -> WorkflowReply:
        """Run the trajectory; ``turns``: where its later turns run (None: all on ``engine``)."""
        while True:
            client = PinnedEngineClient(engine, sample_id, version, sampling, routed_experts=routed_experts,
                                        max_seq_len=self.max_seq_len, turns=turns)
            try:
                traj = await self.workflow(prompt, list(prompt_ids), client, self.ctx)
            except TrajectoryAborted:  # from any of its calls (a turn's placement too): dropped, not failed
                traj, client.aborted = None, True
            except Exception as err:
                if client.engine_error is not None:  # the instance's (or the controller's) fault: the runtime's
                    raise client.engine_error from None
                raise self._failed(sample_id, f"{type(err).__name__}: {err}") from err
            if client.retag is None:
                break
            self.counts["env/trajectories_aborted"] += 1  # placed on newer weights: run again on them
            engine, version = client.engine, client.retag
        if client.aborted:
            self.counts["env/trajectories_aborted"] += 1
            return WorkflowReply([], [], {"type": "abort"}, client.versions_used)
        try:
            if not isinstance(traj, Trajectory):
                raise ValueError(f"the workflow returned a {type(traj).__name__}, not a Trajectory")
            traj.check()
            traj = _within(traj, client.budget)
            logprobs = check_token_in_token_out(traj, client.calls)
        except ValueError as err:
            raise self._failed(sample_id, str(err)) from err
        self.failures.pop(sample_id, None)
        self.counts["env/trajectories"] += 1
        self.counts["env/turns"] += traj.turns
        for key, value in traj.metrics.items():
            self.counts[key] = self.counts.get(key, 0.0) + float(value)
        return WorkflowReply(list(traj.response_ids), logprobs, {"type": traj.finish_reason or "stop"},
                             client.versions_used, prompt_ids=list(traj.prompt_ids), loss_mask=list(traj.loss_mask),
                             reward=traj.reward, turns=traj.turns, metrics=dict(traj.metrics), raw=client.last_raw)



def workflow_runner(spec: str, options: Mapping[str, Any], codec: Any,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    max_seq_len: int | None = None) -> WorkflowRunner | None:
    """The runner of ``rollout.workflow`` = ``spec`` (None for the default single turn, which the
    runtime runs itself) with ``rollout.workflow_kwargs`` = ``options``; ``codec``: the job's
    prompt renderer (its transformers tokenizer and EOS ids are the workflow's); ``max_seq_len``:
    the trainer's, which every trajectory must fit.

    A workflow may carry a ``check_options(options, ctx)`` attribute that raises ValueError for
    options it cannot run with: it is called here, so a typo in ``rollout.workflow_kwargs`` stops
    the job before any process starts instead of failing every trajectory."""
    if spec == SINGLE_TURN:
        return None
    ctx = WorkflowContext(getattr(codec, "tokenizer", None), tuple(codec.eos_ids), dict(options),
                          dict(chat_template_kwargs or {}))
    fn = load_workflow(spec)
    check = getattr(fn, "check_options", None)
    if check is not None:
        try:
            check(ctx.options, ctx)
        except ValueError as err:
            raise WorkflowLoadError(str(err)) from None
    return WorkflowRunner(fn, ctx, max_seq_len)
