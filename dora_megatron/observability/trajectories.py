"""What multi-turn trajectories did: turns, model tokens per turn, tool calls, their latency.

WHY its own record: a trajectory's length is no longer one number. Its turns and its tools' wall
time are what spread the tail of a tool-using rollout (a trajectory of 4 turns with a 2 s tool
between each holds its group back as much as a very long single answer), so the run reports them
beside the response lengths, per step (TensorBoard, ``steps.jsonl``) and for the run
(``summary.json``). Both drivers feed the same event: the runtime one per finished workflow
trajectory, the simulator one per finished multi-turn sample of its workload.

Sums, not lists, are kept per step (:class:`TrajectoryTotals`): a step's row stays a few numbers
however many trajectories it saw, and a resumed run's summary adds the rows back up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class TrajectoryStats:
    """One finished trajectory. ``model_tokens``: its tokens the model generated (loss mask 1);
    ``tool_calls``: the calls it made (malformed ones included); ``well_formed_calls``: those whose
    format parsed (a name and arguments), whatever the tool then answered; ``tool_latency_s``: the
    wall seconds of all its calls together."""

    turns: int
    model_tokens: int
    tool_calls: int = 0
    well_formed_calls: int = 0
    tool_latency_s: float = 0.0
    tool_errors: int = 0
    tool_timeouts: int = 0

    @classmethod
    def of(cls, turns: int, model_tokens: int, counts: Mapping[str, Any]) -> "TrajectoryStats":
        """From a workflow's per-trajectory counts (``Trajectory.metrics``: ``env/tool_calls``,
        ``env/tool_calls_well_formed``, ``env/tool_latency_s``, ``env/tool_errors``,
        ``env/tool_timeouts``; a count the workflow does not report is 0)."""
        def n(key: str) -> float:
            return float(counts.get(key, 0.0) or 0.0)

        return cls(int(turns), int(model_tokens), int(n("env/tool_calls")), int(n("env/tool_calls_well_formed")),
                   n("env/tool_latency_s"), int(n("env/tool_errors")), int(n("env/tool_timeouts")))


@dataclass
class TrajectoryTotals:
    """Sums over trajectories (a step's, or the run's); :meth:`scalars` gives the means."""

    trajectories: int = 0
    turns: int = 0
    model_tokens: int = 0
    tool_calls: int = 0
    tool_users: int = 0  # trajectories with at least one well-formed call
    tool_latency_s: float = 0.0
    tool_errors: int = 0
    tool_timeouts: int = 0

    def add(self, t: TrajectoryStats) -> None:
        self.trajectories += 1
        self.turns += t.turns
        self.model_tokens += t.model_tokens
        self.tool_calls += t.tool_calls
        self.tool_users += t.well_formed_calls > 0
        self.tool_latency_s += t.tool_latency_s
        self.tool_errors += t.tool_errors
        self.tool_timeouts += t.tool_timeouts

    @classmethod
    def total(cls, parts: Iterable[Mapping[str, Any]]) -> "TrajectoryTotals":
        """The sum of several totals given as dicts (steps' rows; empty for a step without any)."""
        out = cls()
        for part in parts:
            for key, value in part.items():
                setattr(out, key, getattr(out, key) + value)
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) if self.trajectories else {}

    def scalars(self) -> dict[str, float | None]:
        """Means (None where nothing was counted): turns per trajectory, model tokens per turn,
        seconds per tool call, the share of trajectories that used a tool; and the error and
        timeout counts (None without trajectories)."""
        n = self.trajectories
        return {
            "turns_per_trajectory": self.turns / n if n else None,
            "tokens_per_turn": self.model_tokens / self.turns if self.turns else None,
            "tool_latency_s": self.tool_latency_s / self.tool_calls if self.tool_calls else None,
            "tool_use_rate": self.tool_users / n if n else None,
            "tool_errors": self.tool_errors if n else None,
            "tool_timeouts": self.tool_timeouts if n else None,
        }
