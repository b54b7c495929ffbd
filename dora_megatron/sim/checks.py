"""The simulator's own check of the orchestrator, independent of its counters: every released
batch holds TBS groups it dispatched, none consumed before (C2), within the staleness bound (C3),
complete (none lost), and none after the run's last step (exactly TBS groups per trained step).

WHY in the simulator too: the orchestrator counts C1-C3 itself; a check that reads only what the
simulator saw happen (dispatches, finishes, releases) catches a bug in those counters as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.orchestrator.actions import ReleaseBatch
from dora_megatron.sim.workload import GroupSpec


class SimProtocolError(RuntimeError):
    """The orchestrator asked for something a real engine would refuse (a bug to fix)."""


@dataclass
class GroupState:
    """The simulator's record of a dispatched group."""

    spec: GroupSpec
    version: int
    sample_ids: tuple[str, ...]
    finished: int = 0
    consumed: int = 0
    dispatch_s: float = 0.0
    complete_s: float | None = None


class ReleaseChecks:
    """Checks each released batch; counts the C3 violations and lost groups it saw."""

    def __init__(self, steps: int, tbs: int, max_staleness: int) -> None:
        self.steps = steps
        self.tbs = tbs
        self.S = max_staleness
        self.c3 = 0
        self.lost = 0

    def release(self, a: ReleaseBatch, groups: dict[str, GroupState], trainer_busy: bool) -> list[GroupState]:
        """Marks the groups of ``a`` consumed; returns those consumed for the first time (a group
        released twice is counted over the step records: ``observability.summary.duplicated_groups``). Raises on a batch a trainer
        would refuse."""
        if trainer_busy:
            raise SimProtocolError(f"batch {a.step} released while the trainer is busy")
        if a.step >= self.steps:
            raise SimProtocolError(f"batch {a.step} released after the last step ({self.steps} steps): "
                                   "its groups would be consumed and never trained")
        if len(a.group_ids) != self.tbs:
            raise SimProtocolError(f"batch {a.step} has {len(a.group_ids)} groups, TBS={self.tbs}")
        fresh = []
        for gid in a.group_ids:
            g = groups.get(gid)
            if g is None:
                raise SimProtocolError(f"release of unknown group {gid}")
            g.consumed += 1
            if g.consumed > 1:
                continue  # trained once (duplicated_groups counts the listing: observability.summary)
            if g.finished < len(g.sample_ids):
                self.lost += 1  # its unfinished samples would be dropped
            lag = a.step - g.version
            if lag > self.S or lag < 0:
                self.c3 += 1
            fresh.append(g)
        return fresh
