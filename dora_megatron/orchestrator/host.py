"""What the orchestrator's rule modules and its checkpoint see of it: its run counters and the
:class:`RuleHost` protocol.

WHY a protocol: the dora rebalancer (:mod:`.rebalance`), the single-version rules
(:mod:`.single_version`) and the checkpoint (:mod:`.snapshot`) act on the orchestrator's records,
index and action list; typing them against this protocol instead of the class keeps the modules
free of an import of :mod:`.core` (no cycle) and lists in one place what they may touch.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator.actions import Action
from dora_megatron.orchestrator.index import PoolIndex
from dora_megatron.orchestrator.policy import ModePolicy
from dora_megatron.types import Group, Instance, Sample


@dataclasses.dataclass
class Counters:
    """Run counters; a counter that is a summary.json field (DESIGN section 11) has its name."""

    dispatched_groups: int = 0
    consumed_groups: int = 0
    #: groups a batch selection listed again after their consumption (select_batch offers only
    #: unconsumed ones, so never expected). Not the summary's ``duplicated_groups``, which counts
    #: groups trained twice over the step records, a resumed run's included
    #: (``observability/summary.py::duplicated_groups``); hence a name of its own.
    duplicate_releases: int = 0
    c1_violations: int = 0
    c3_violations: int = 0
    max_consumed_staleness: int = 0
    staleness_histogram: dict[int, int] = dataclasses.field(default_factory=dict)
    migrations: int = 0
    reprefill_tokens: int = 0
    interrupts: int = 0
    switches: int = 0
    rebalances: int = 0
    max_live_versions: int = 0
    ignored_events: int = 0
    workflow_turn_moves: int = 0
    dual_switches: int = 0


class RuleHost(Protocol):
    """The orchestrator as its rule modules use it (:class:`~.core.Orchestrator` implements it)."""

    config: OrchestratorConfig
    policy: ModePolicy
    index: PoolIndex
    counters: Counters
    groups: dict[str, Group]
    samples: dict[str, Sample]
    instances: dict[str, Instance]
    S: int
    tbs: int
    G: int
    newest: int
    next_step: int
    trainer_busy: bool
    now: float
    _group_seq: int
    _cap_after: bool
    _last_rebalance: float | None
    _last_kv_rebalance: float | None
    _out: list[Action]

    @property
    def outstanding(self) -> int: ...

    def _switch(self, inst: Instance, version: int, *, rebalance: bool = False, keep: bool = False) -> None: ...

    def _admissible_new(self) -> int: ...

    def _set_cap_phase(self, after: bool) -> None: ...

    def _pool_view(self) -> tuple[int, list[int], set[int]]: ...

    def _create_group(self, version: int) -> None: ...

    def _place_pending(self) -> None: ...
