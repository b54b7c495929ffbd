"""The simulated trainer: one step at a time, and what a released batch costs it.

WHY a record of its own (:class:`SimStep`): the step's numbers (wait, train and sync time, tokens,
staleness, response lengths) are fixed when the batch is released and read when the step ends, when
they become the run's one record of the step (the recorder's
:class:`~dora_megatron.observability.summary.StepRecord`) and the ``TrainerDone`` event; between the
two, the trainer holds them. It is not a second record of the run: nothing keeps it past its step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dora_megatron.orchestrator.actions import ReleaseBatch
from dora_megatron.sim.checks import GroupState


@dataclass(frozen=True)
class SimStep:
    """The step being trained, as fixed when its batch was released (times in seconds)."""

    step: int
    wait_s: float  # trainer idle from the end of its last step to this release (the rollout-only time)
    train_s: float  # training compute of the batch's tokens
    sync_s: float  # the weight push or role swap after training (the step's last seconds)
    tokens: int  # prompt + response tokens of the groups trained for the first time
    staleness: tuple[int, ...]  # step - version of each such group
    lengths: tuple[int, ...]  # response tokens of each of their samples
    groups: tuple[str, ...]  # the batch's group ids, as released
    versions: tuple[int, ...]  # each released group's version

    @property
    def mean_len(self) -> float:
        """Mean response tokens of the step's samples (0 when it trained none)."""
        return sum(self.lengths) / len(self.lengths) if self.lengths else 0.0

    @property
    def max_len(self) -> int:
        """Longest response of the step's samples (0 when it trained none)."""
        return max(self.lengths) if self.lengths else 0

    @property
    def bubble(self) -> float:
        """The length bubble ``(max - mean) / max`` of the step's responses: the share of the
        longest response's decode time the batch's other samples leave idle (0 with no samples)."""
        max_len = self.max_len
        return (max_len - self.mean_len) / max_len if max_len else 0.0


@dataclass
class SimTrainer:
    busy: bool = False
    idle_since: float = 0.0
    steps_done: int = 0
    current: SimStep | None = None  # the step being trained (see :meth:`start`)

    def start(self, a: ReleaseBatch, groups: list[GroupState], now: float, train_s: Callable[[int], float],
              sync_s: float) -> float:
        """Train the batch ``a`` on ``groups`` (its groups trained for the first time; ``train_s``:
        seconds for a number of tokens; ``sync_s``: the weight push or role swap after it);
        returns when the step ends."""
        step = a.step
        tokens = 0
        stal: list[int] = []
        lengths: list[int] = []
        for g in groups:
            stal.append(step - g.version)
            tokens += g.spec.total_tokens
            lengths.extend(g.spec.response_tokens)
        self.busy = True
        train = train_s(tokens)
        self.current = SimStep(step=step, wait_s=now - self.idle_since, train_s=train, sync_s=sync_s, tokens=tokens,
                               staleness=tuple(stal), lengths=tuple(lengths), groups=tuple(a.group_ids),
                               versions=tuple(a.versions))
        return now + train + sync_s

    def finish(self, now: float) -> SimStep:
        """The step ended at ``now``: the trainer waits for the next batch. Returns its record."""
        if self.current is None:
            raise RuntimeError(f"SimTrainer.finish at t={now}: no step is being trained (start was not called)")
        self.busy = False
        self.idle_since = now
        self.steps_done += 1
        return self.current
