"""Actions the orchestrator asks its driver to perform (frozen dataclasses, JSON-able via asdict).

WHY a closed vocabulary: the runtime turns each action into HTTP calls, the simulator into
virtual-clock events; both must execute the same list in order. Ordering contract: within one
returned list, actions are in causal order (a group's ``Dispatch`` precedes its ``Submit``s; a
``Migrate`` or ``Interrupt`` away from an instance precedes that instance's ``SwitchVersion``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A new group exists: attach a prompt to ``group_id`` (G samples ``sample_ids``), all tagged
    ``version``. Placement follows as ``Submit`` actions (possibly later, when slots free up)."""

    group_id: str
    version: int
    sample_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Submit:
    """Start (or resume) ``sample_id`` on ``instance`` with weights ``version``: send the prompt plus
    any partial output the driver holds for it (``resume``: it has one, i.e. re-prefill). Covers
    first placement, failure re-queue and partial-mode resubmission (abort-and-resubmit)."""

    sample_id: str
    instance: str
    version: int
    resume: bool = False


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move the in-flight request ``sample_id`` from ``src`` to ``dst`` (both on ``version``),
    keeping its state (KV export/import). A driver without native migration aborts at ``src`` and
    resubmits prompt+partial at ``dst`` and reports the re-prefill via ``on_migration_done``."""

    sample_id: str
    src: str
    dst: str
    version: int


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Abort ``sample_id`` on ``instance`` keeping its partial output (partial mode, before a
    weight update); a later ``Submit(resume=True)`` continues it."""

    sample_id: str
    instance: str


@dataclass(frozen=True, slots=True)
class SwitchVersion:
    """Load weights ``version`` on ``instance`` (from a peer or the per-version snapshot). The
    instance holds no request of its old version; it takes none until ``on_switch_done``.
    ``rebalance``: a rebalance ordered it (the instance moves between live versions to even out the
    load), as opposed to following the newest version, joining, or restoring a version after a
    failure; drivers count its load time as rebalancing overhead (``rebalance_fraction``).
    ``keep``: a dual-version switch (``orchestrator.dual_version``): the instance still holds
    requests of version ``keep``; it keeps those weights beside the new ones and finishes them on
    them (C1), then drops them. Without ``keep`` the instance holds no request."""

    instance: str
    version: int
    rebalance: bool = False
    keep: int | None = None


@dataclass(frozen=True, slots=True)
class ReleaseBatch:
    """Train step ``step`` on exactly TBS complete groups (oldest version first)."""

    step: int
    group_ids: tuple[str, ...]
    versions: tuple[int, ...]


Action = Dispatch | Submit | Migrate | Interrupt | SwitchVersion | ReleaseBatch


class ActionHandler(Protocol):
    """What executes the orchestrator's actions: the asyncio runtime (HTTP calls,
    :class:`~dora_megatron.controller.runtime.Runtime`), the simulator (virtual-clock events,
    :class:`~dora_megatron.sim.engine.Simulator`) and the unit-test driver all implement it.

    WHY one protocol with one method per action: a reader finds what each driver does for
    ``Submit`` by name, and a new action type is a type error in every driver, not a missing
    ``_do_<name>`` found at run time. Each method starts the action and returns; what comes of it
    (a finished sample, a completed switch) is reported to the orchestrator later as an event."""

    def dispatch(self, a: Dispatch) -> None: ...
    def submit(self, a: Submit) -> None: ...
    def migrate(self, a: Migrate) -> None: ...
    def interrupt(self, a: Interrupt) -> None: ...
    def switch_version(self, a: SwitchVersion) -> None: ...
    def release_batch(self, a: ReleaseBatch) -> None: ...


def perform(handler: ActionHandler, actions: Iterable[Action]) -> None:
    """Hand ``actions`` to ``handler`` in order (the ordering contract above): the one place where
    an action is mapped to the handler method that carries it out."""
    for a in actions:
        if isinstance(a, Dispatch):
            handler.dispatch(a)
        elif isinstance(a, Submit):
            handler.submit(a)
        elif isinstance(a, Migrate):
            handler.migrate(a)
        elif isinstance(a, Interrupt):
            handler.interrupt(a)
        elif isinstance(a, SwitchVersion):
            handler.switch_version(a)
        elif isinstance(a, ReleaseBatch):
            handler.release_batch(a)
        else:
            raise TypeError(f"unknown action {a!r}")
