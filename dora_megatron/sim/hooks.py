"""The simulator's side of the one event mapping (:class:`~dora_megatron.events.EventMapping`):
the bookkeeping hooks of :class:`~dora_megatron.events.mapping.Executor`.

WHY apart: the runtime needs these hooks for stale reports, the journal and checkpoints; the
simulator has none of those (it drops a stale switch or wake itself, reports only instances in the
pool, keeps no journal and writes no checkpoint), so most answers are constants, and the executor
(:class:`~.engine.Simulation`) stays about carrying out actions.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from dora_megatron.events import EngineReply, InstanceFailed, InstanceJoined, SwitchDone, TrainerDone
from dora_megatron.orchestrator.actions import Action
from dora_megatron.sim.checks import GroupState, SimProtocolError
from dora_megatron.sim.events import EventQueue
from dora_megatron.sim.instance import SimRequest


class _Run(Protocol):
    """What the hooks read of the simulation."""

    q: EventQueue
    groups: dict[str, GroupState]
    reqs: dict[str, SimRequest]
    tooling: dict[str, tuple[SimRequest, str, bool]]
    spans: dict[str, set[int]]

    def execute(self, actions: list[Action]) -> None: ...

    def step_boundary(self) -> bool: ...


class MappingHooks:
    """The :class:`~dora_megatron.events.mapping.Executor` the simulator hands the mapping: its
    actions go to the simulation (``execute``), its questions are answered here."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def now(self) -> float:
        return self.run.q.now

    def execute(self, actions: list[Action]) -> None:
        self.run.execute(actions)

    def prompt_tokens(self, group_id: str) -> int:
        return self.run.groups[group_id].spec.prompt_tokens

    def absorb(self, ev: EngineReply) -> int:
        return int(ev.resp)  # the simulated answer is its length

    def turn_current(self, sample_id: str, turn: object) -> bool:
        """The turn event is about the trajectory's present turn (``turn``: its index)."""
        entry = self.run.tooling.get(sample_id)
        return entry is not None and entry[0].turn == turn

    def sample_versions(self, sample_id: str) -> Iterable[int]:
        return self.run.spans.get(sample_id) or (self.run.reqs[sample_id].version,)

    def replayed(self, sample_id: str) -> int:
        raise SimProtocolError(f"replay of {sample_id}: the simulator keeps no journal")

    def is_current(self, instance: str, engine: object) -> bool:
        return True

    def switch_landed(self, ev: SwitchDone, origin: Any) -> bool:
        return True

    def mark_failed(self, ev: InstanceFailed, origin: Any) -> bool:
        return True

    def register(self, ev: InstanceJoined) -> bool:
        return True

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        return int(ev.result["version"]), False  # the step's metrics were recorded as it ended

    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        raise SimProtocolError(f"checkpoint v{version}: the simulator writes none")

    def step_boundary(self) -> bool:
        """The run's last step ended (the mapping then does not tell the orchestrator)."""
        return self.run.step_boundary()
