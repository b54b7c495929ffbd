"""The one mapping from events to orchestrator calls, shared by the runtime and the simulator.

The runtime's :class:`~dora_megatron.controller.loop.ControllerLoop` applies it to each event of
its queue; the simulator (``sim/engine.py``) to each event of its virtual clock. The driver supplies
an :class:`Executor`: the bookkeeping that goes with each event (per-sample records, pool
membership, step logs, checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol

from dora_megatron.events.event import (CheckpointSaved, EngineReply, Event, InstanceFailed, InstanceJoined, InstanceStats,
                                        MigrationDone, MigrationFailed, Replayed, Resume, SampleProgress, Start, Stop,
                                        SwitchDone, Tick, TrainerDone, TurnEnded, TurnReady)
from dora_megatron.orchestrator import Action, ActionHandler, Dispatch, Orchestrator

if TYPE_CHECKING:
    import asyncio


class Executor(ActionHandler, Protocol):
    """What the loop needs of the runtime besides carrying out actions: the bookkeeping that goes
    with each event (per-sample records, pool membership, step logs, checkpoints). Each returns
    whether (or with what) the orchestrator is to hear of the event."""

    def now(self) -> float: ...
    def execute(self, actions: list[Action]) -> None: ...
    def prompt_tokens(self, group_id: str) -> int: ...
    def absorb(self, ev: EngineReply) -> int | None: ...
    def sample_versions(self, sample_id: str) -> Iterable[int]: ...
    def replayed(self, sample_id: str) -> int | None: ...  # None: reported before (the orchestrator ignores it)
    def turn_current(self, sample_id: str, turn: object) -> bool: ...  # (the driver's own turn handle)
    def is_current(self, instance: str, engine: object) -> bool: ...  # (the driver's own engine handle)
    def switch_landed(self, ev: SwitchDone, origin: asyncio.Task[Any] | None) -> bool: ...
    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task[Any] | None) -> bool: ...
    def register(self, ev: InstanceJoined) -> bool: ...
    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]: ...
    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None: ...
    def step_boundary(self) -> bool: ...


class EventMapping:
    """The one mapping from events to orchestrator calls, without a queue: what the controller loop
    does in a turn, and what the simulator (``sim/engine.py``) does with each event of its virtual
    clock. WHY one mapping: the simulator is to predict what ``dora train`` does, so it must feed
    the orchestrator exactly as the runtime does (the same bookkeeping hooks, the same calls, the
    end of the run decided at the same point)."""

    def __init__(self, orch: Orchestrator, executor: Executor) -> None:
        self.orch = orch
        self.executor = executor

    def step(self, event: Event, origin: asyncio.Task[Any] | None = None) -> None:
        """One turn: ``event`` -> orchestrator -> actions -> executor."""
        self.act(self.feed(event, origin))

    def act(self, actions: list[Action]) -> None:
        """Hand ``actions`` (what :meth:`feed` returned) to the executor."""
        if actions:
            self.executor.execute(actions)
            for a in actions:  # the orchestrator accounts re-prefill against the prompt's length
                if isinstance(a, Dispatch):
                    self.orch.set_prompt_tokens(a.group_id, self.executor.prompt_tokens(a.group_id))

    def feed(self, event: Event, origin: asyncio.Task[Any] | None = None) -> list[Action]:
        """The event's bookkeeping in the executor, then the orchestrator call it maps to."""
        ex, orch = self.executor, self.orch
        if isinstance(event, Start):
            return orch.start()
        if isinstance(event, Resume):
            actions: list[Action] = []
            for iid in event.instances:  # fresh processes: re-queue what ran there, switch them anew
                actions += orch.on_instance_failed(iid)
            for iid in event.instances:
                actions += orch.on_instance_joined(iid)
            if event.pending_step is not None:
                actions += orch.on_step_finished(int(event.pending_step))
            return actions + orch.poll()
        if isinstance(event, EngineReply):
            tokens = ex.absorb(event)
            if tokens is None:  # partial (interrupted, moved) or delivered by the KV import
                return []
            # every version that produced its tokens, as the engines said (the orchestrator alone counts C1)
            orch.on_sample_versions(event.sample_id, ex.sample_versions(event.sample_id))
            return orch.on_sample_finished(event.sample_id, tokens=tokens, now=event.end)
        if isinstance(event, (TurnEnded, TurnReady)):
            if not ex.turn_current(event.sample_id, event.turn):
                return []  # a dropped run's (moved, interrupted, re-queued): the orchestrator placed it anew
            if isinstance(event, TurnEnded):
                return orch.on_turn_ended(event.sample_id)
            return orch.on_turn_ready(event.sample_id)
        if isinstance(event, SampleProgress):
            return orch.on_sample_progress(event.sample_id, event.tokens)
        if isinstance(event, Replayed):
            tokens = ex.replayed(event.sample_id)
            orch.on_sample_versions(event.sample_id, ex.sample_versions(event.sample_id))
            return orch.on_sample_finished(event.sample_id, tokens=tokens, now=ex.now())
        if isinstance(event, InstanceStats):
            if not ex.is_current(event.instance, event.engine):
                return []  # failed or replaced while it was asked
            return orch.on_instance_stats(event.instance, event.running, event.kv_usage, now=ex.now())
        if isinstance(event, Tick):
            return orch.on_tick(ex.now())
        if isinstance(event, SwitchDone):
            if not ex.switch_landed(event, origin):
                return []  # re-targeted, failed or replaced meanwhile: the newest order reports
            return orch.on_switch_done(event.instance, event.version)
        if isinstance(event, MigrationDone):
            return orch.on_migration_done(event.sample_id, reprefill_tokens=event.reprefill_tokens)
        if isinstance(event, MigrationFailed):
            return orch.on_migration_failed(event.sample_id)
        if isinstance(event, InstanceFailed):
            if not ex.mark_failed(event, origin):
                return []  # already failed, or a stale report through a replaced client
            return orch.on_instance_failed(event.instance)
        if isinstance(event, InstanceJoined):
            if not ex.register(event):
                return []
            return orch.on_instance_joined(event.instance)
        if isinstance(event, TrainerDone):
            version, checkpoint_due = ex.record_step(event, len(orch.live_versions()))
            if checkpoint_due:
                return []  # the trainer's checkpoint is being written; CheckpointSaved follows
            return self._step_finished(version)
        if isinstance(event, CheckpointSaved):
            # at the step boundary: weights ``version`` exist, the orchestrator has not reacted to
            # them yet (resume replays on_step_finished(version))
            ex.write_controller_state(event.version, orch.snapshot())
            return self._step_finished(event.version)
        if isinstance(event, Stop):
            return []
        raise TypeError(f"unknown event {event!r}")

    def _step_finished(self, version: int) -> list[Action]:
        if self.executor.step_boundary():
            return []  # the last step: the run ends
        return self.orch.on_step_finished(version)
