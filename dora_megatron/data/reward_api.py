"""The seam between the controller and a reward: what a reward sees, what it returns, how it is awaited.

WHY a protocol with an ``async`` method: the controller's event loop must never run a user's reward
function (it may take seconds, raise, or hang). The controller awaits :meth:`RewardScorer.score` in a
task of its own and feeds the result back as an event; where the function runs (a thread, a pool of
worker processes with a time limit) is the scorer's business. The fields of :class:`RewardInput` are
verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` arguments, so a verl
reward file plugs in unchanged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol


@dataclass(frozen=True)
class RewardInput:
    """One finished sample as a reward function sees it."""

    data_source: str  # the dataset row's ``data_source`` ("" for the built-in tasks)
    solution_str: str  # the response, decoded with special tokens skipped
    ground_truth: Any  # the row's ground truth (``data.answer_key``)
    extra_info: Mapping[str, Any] = field(default_factory=dict)  # the row's ``extra_info``


@dataclass(frozen=True)
class RewardResult:
    """A reward: ``score`` trains; ``extras`` are logged as ``reward/<key>``; ``error`` says why the
    function failed (raised or timed out), in which case ``score`` is 0.0 and the run goes on."""

    score: float
    extras: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None  # the failure's traceback, for the one log line the controller writes


class RewardScorer(Protocol):
    """Scores finished samples off the controller's event loop: :meth:`score` for a caller on the
    loop (the eval rounds, the bench's capacity pass), :meth:`score_sync` for one in a worker thread
    (the training samples' scores, :class:`~dora_megatron.controller.samples.SampleStore`). Neither
    raises for the function's failure: it is the result's ``error``."""

    async def score(self, item: RewardInput) -> RewardResult: ...

    def score_sync(self, item: RewardInput) -> RewardResult: ...

    async def aclose(self) -> None: ...


def reward_input(prompt: Any, solution_str: str) -> RewardInput:
    """What a reward sees of a finished sample of ``prompt`` (a :class:`~dora_megatron.data.tasks.Prompt`):
    the response decoded with special tokens skipped, and the row's ground truth, ``data_source``
    and ``extra_info``."""
    return RewardInput(getattr(prompt, "data_source", ""), solution_str, prompt.answer,
                       getattr(prompt, "extra_info", None) or {})


class ThreadScorer:
    """A plain ``fn(solution_str, ground_truth) -> float`` run on a worker thread (the built-in
    tasks' rewards): the loop awaits it like any other scorer. An exception is a 0 reward with the
    error recorded, never a failed run."""

    def __init__(self, fn: Callable[[str, Any], float]) -> None:
        self.fn = fn

    def score_sync(self, item: RewardInput) -> RewardResult:
        """:meth:`score` on the calling thread (a caller that is not on an event loop)."""
        try:
            return RewardResult(float(self.fn(item.solution_str, item.ground_truth)))
        except Exception as err:  # noqa: BLE001 - a reward's failure is the sample's, not the run's
            import traceback

            return RewardResult(0.0, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())

    async def score(self, item: RewardInput) -> RewardResult:
        return await asyncio.to_thread(self.score_sync, item)

    async def aclose(self) -> None:
        return None
