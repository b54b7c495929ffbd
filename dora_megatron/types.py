"""Plain records shared by the orchestrator, the runtime and the simulator (stdlib only).

WHY: the orchestrator is sans-IO and must be snapshotted to JSON, inspected by the simulator and
driven by the asyncio runtime; keeping its records as small stdlib dataclasses (no torch, no
pydantic) makes all three cheap and lets ``dataclasses.asdict`` be the serialisation.

Definitions follow DESIGN section 2: a *version* is an integer (initial weights = 0, step ``t``
consumes ``B_t`` and produces ``t + 1``); a *group* is one prompt with its ``G`` samples, all
tagged with the group's version at dispatch; a *batch* is exactly TBS complete groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Sample states.
PENDING = "pending"    # tagged with a version, waiting for an instance of that version
RUNNING = "running"    # placed on an instance (generating, or queued inside the engine)
FINISHED = "finished"  # all tokens generated; waits for its group to complete
WAITING = "waiting"    # a workflow's trajectory between turns: off every engine while its tool runs


@dataclass(slots=True)
class Sample:
    """One trajectory of a group.

    ``version`` is the version that generates its tokens now; ``min_version``/``max_version``
    span every version that produced tokens for it (equal unless ``partial`` mode re-tagged it:
    a C1 violation). ``tokens`` is the generated length reported so far.
    """

    sample_id: str
    group_id: str
    index: int
    version: int
    min_version: int
    max_version: int
    instance: str | None = None
    state: str = PENDING
    tokens: int = 0
    submissions: int = 0
    reprefill_tokens: int = 0
    turn_from: str | None = None  # between turns: the instance of the turn that just ended


@dataclass(slots=True)
class Group:
    """One prompt and its G samples; released to training only when all are finished."""

    group_id: str
    version: int
    seq: int
    sample_ids: list[str]
    prompt_tokens: int = 0
    n_finished: int = 0
    consumed_step: int | None = None

    @property
    def complete(self) -> bool:
        return self.n_finished == len(self.sample_ids)


@dataclass(slots=True)
class Instance:
    """One rollout instance (a DP group serving one version at a time; with
    ``orchestrator.dual_version`` it may also finish the tail of the version it served before, on
    that version's weights, which it keeps until the tail drains)."""

    instance_id: str
    version: int | None
    target: int | None = None          # version it is switching to (None: not switching)
    alive: bool = True
    samples: set[str] = field(default_factory=set)  # every request it holds, tail included
    reported_running: int = 0
    kv_usage: float = 0.0
    tail_version: int | None = None    # version of the tail it still decodes (None: no tail)
    tail_left: int = 0                 # requests of ``tail_version`` still on it

    @property
    def switching(self) -> bool:
        return self.target is not None

    @property
    def load(self) -> int:
        return len(self.samples)


@dataclass(frozen=True, slots=True)
class Batch:
    """Training batch ``B_step``: exactly TBS group ids, oldest version first."""

    step: int
    group_ids: tuple[str, ...]
    versions: tuple[int, ...]
