"""The simulated trainer: one step at a time, and what a released batch costs it.

WHY a record of its own: the step's numbers (wait, train and sync time, tokens, staleness, the
length bubble) are fixed when the batch is released and read when the step ends (metrics, the
plots' series, the ``TrainerDone`` event), so one record carries them between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from dora_megatron.orchestrator.actions import ReleaseBatch
from dora_megatron.sim.checks import GroupState


@dataclass
class SimTrainer:
    busy: bool = False
    idle_since: float = 0.0
    steps_done: int = 0
    current: dict[str, Any] = field(default_factory=dict)  # the step being trained (see :meth:`start`)

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
        wait = now - self.idle_since
        train = train_s(tokens)
        mean_len = sum(lengths) / len(lengths) if lengths else 0.0
        max_len = max(lengths) if lengths else 0
        self.current = {
            "step": step, "wait_s": wait, "train_s": train, "sync_s": sync_s, "tokens": tokens,
            "staleness": stal, "bubble": (max_len - mean_len) / max_len if max_len else 0.0,
            "mean_len": mean_len, "max_len": max_len, "lengths": lengths,
            "groups": a.group_ids, "versions": a.versions,
        }
        return now + train + sync_s

    def finish(self, now: float) -> dict[str, Any]:
        """The step ended at ``now``: the trainer waits for the next batch. Returns its record."""
        self.busy = False
        self.idle_since = now
        self.steps_done += 1
        return self.current
