"""The controller's main loop: event -> orchestrator -> actions -> executor, one at a time.

Read this file first. Everything that happens during ``dora train`` is an event on one
:class:`EventQueue`; :class:`ControllerLoop` takes them in order, feeds each to the sans-IO
:class:`~dora_megatron.orchestrator.Orchestrator` and hands the actions it returns to the
executor (:class:`~dora_megatron.controller.runtime.Runtime`), which starts HTTP calls as asyncio
tasks. Those tasks never call the orchestrator: when a call returns they put what happened on the
queue. Nothing but this loop calls the orchestrator's event methods.

::

    engine replies, stats, timers,          +-----------------------+
    trainer results, joins, failures  --->  |  EventQueue (FIFO)    |
            ^                               +-----------+-----------+
            |                                           v
            |                       ControllerLoop.feed(event) -> Orchestrator.on_...(...)
            |                                           |  list[Action]
            |                                           v
            +----- asyncio tasks <----- Runtime (ActionHandler): dispatch, submit, migrate, ...

WHY every state change happens here: the executor's per-sample records (tokens, reward, the
journal line) and the orchestrator's view of the same sample change in the same loop turn, so a
checkpoint (written while handling :class:`CheckpointSaved`) never holds a sample the runtime
calls finished and the orchestrator does not. WHY a task ``await``\\ s :meth:`EventQueue.report`:
a sample's next operation waits for the previous one's task (per-sample ordering, see
:mod:`.runtime`); a task that has returned has therefore had its event applied, e.g. the partial
output of an interrupted request is in the record before it is resubmitted. A task cancelled
before its event was handled (its instance failed meanwhile) withdraws the event, as a cancelled
HTTP call would never have reported.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from dora_megatron.orchestrator import Action, ActionHandler, Dispatch

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Start:
    """A fresh run: the orchestrator's first dispatches."""


@dataclass(frozen=True)
class Resume:
    """A run continued from a checkpoint: every instance is a fresh process (what ran there is
    re-queued, each is switched anew); ``pending_step`` is the version whose
    ``on_step_finished`` the checkpoint was written just before."""

    instances: tuple[str, ...]
    pending_step: int | None


@dataclass(frozen=True)
class EngineReply:
    """A ``/generate`` (or KV import) answered for ``sample_id``; ``resp`` is the engine's answer.
    ``reward``: the finished sample's reward, scored off the loop by the task that got the answer
    (None: scored when the reply is applied)."""

    sample_id: str
    instance: str
    resp: Any
    start: float
    end: float
    reward: float | None = None


@dataclass(frozen=True)
class TurnEnded:
    """A turn of ``sample_id``'s workflow returned: the trajectory is off its engine while its tool
    runs (``turn``: the run it belongs to, :class:`~dora_megatron.controller.turns.TurnGate`)."""

    sample_id: str
    turn: Any


@dataclass(frozen=True)
class TurnReady:
    """``sample_id``'s workflow asks for its next turn (the orchestrator places it)."""

    sample_id: str
    turn: Any


@dataclass(frozen=True)
class SampleProgress:
    """A running request of ``sample_id`` has generated ``tokens`` so far. The simulator's instance
    model knows it (and reports it before it moves or re-tags requests, for the re-prefill count and
    the choice of cheap requests to move); the runtime's engines do not report it."""

    sample_id: str
    tokens: int


@dataclass(frozen=True)
class Replayed:
    """A sample the journal restored was submitted: it is finished already."""

    sample_id: str


@dataclass(frozen=True)
class InstanceStats:
    """One instance's load report; ``engine`` is the client that answered (a report through a
    client replaced since is stale)."""

    instance: str
    running: int
    kv_usage: float
    engine: Any


@dataclass(frozen=True)
class Tick:
    """The stats sweep ended: the orchestrator's timer-triggered rebalance may run."""


@dataclass(frozen=True)
class SwitchDone:
    """``instance`` loaded weights ``version`` (from disk or a trainer broadcast, ``how``)."""

    instance: str
    version: int
    engine: Any
    start: float
    end: float
    how: str = "load"


@dataclass(frozen=True)
class MigrationDone:
    """A ``Migrate`` fell back to abort + resubmit; ``reprefill_tokens`` are computed again."""

    sample_id: str
    reprefill_tokens: int


@dataclass(frozen=True)
class MigrationFailed:
    """A move (or a submission the engine's version guard refused) did not happen: re-queue it."""

    sample_id: str


@dataclass(frozen=True)
class InstanceFailed:
    """``instance`` cannot be reached or did wrong; ``engine``: the client that saw it (None: the
    instance's current one, e.g. a supervisor saw the process exit)."""

    instance: str
    why: str
    engine: Any = None


@dataclass(frozen=True)
class InstanceJoined:
    """``engine`` joins the pool as ``instance`` (new, or a failed name coming back)."""

    instance: str
    engine: Any


@dataclass(frozen=True)
class TrainerDone:
    """The trainer answered ``/train`` for ``step``."""

    step: int
    result: dict
    start: float
    train_s: float
    batch: Any  # what the executor noted when it released the batch (rewards, lengths, staleness, ...)


@dataclass(frozen=True)
class CheckpointSaved:
    """The trainer's part of checkpoint ``version`` is on disk: the controller's part follows."""

    version: int


@dataclass(frozen=True)
class Stop:
    """Wakes the loop when the run ends (every step done, or an error)."""


Event = (Start | Resume | EngineReply | TurnEnded | TurnReady | SampleProgress | Replayed | InstanceStats | Tick | SwitchDone | MigrationDone | MigrationFailed
         | InstanceFailed | InstanceJoined | TrainerDone | CheckpointSaved | Stop)


# ---------------------------------------------------------------------------------------- queue
class EventQueue:
    """The single FIFO the loop reads. ``post`` from anywhere on the event-loop thread;
    ``await report(...)`` from a task that must not go on before its event was applied."""

    def __init__(self) -> None:
        self._q: asyncio.Queue = asyncio.Queue()
        self._closed = False

    def post(self, event: Event) -> None:
        self._q.put_nowait((event, None, None))

    async def report(self, event: Event) -> None:
        """Queue ``event`` and wait until the loop applied it. After :meth:`close` (the loop has
        ended) the reporting task is cancelled instead: nobody will ever apply the event."""
        if self._closed:
            raise asyncio.CancelledError(f"the controller loop has ended: {type(event).__name__} not applied")
        fut = asyncio.get_running_loop().create_future()
        self._q.put_nowait((event, fut, asyncio.current_task()))
        await fut

    def close(self) -> None:
        """The loop has ended: cancel every report still waiting, and any later one.

        WHY: at shutdown the runtime cancels its tasks, but on Python 3.11 ``asyncio.wait_for``
        can swallow a cancellation that arrives as its inner call completes (fixed in 3.12). A
        request task that lost its cancel that way went on to report its reply and waited forever
        for a loop that had stopped (a test run hung once in CI)."""
        self._closed = True
        while not self._q.empty():
            _, fut, _ = self._q.get_nowait()
            if fut is not None and not fut.done():
                fut.cancel()

    async def get(self) -> tuple[Event, asyncio.Future | None, asyncio.Task | None]:
        return await self._q.get()

    def __len__(self) -> int:
        return self._q.qsize()


# ---------------------------------------------------------------------------------------- executor side
class Executor(ActionHandler, Protocol):
    """What the loop needs of the runtime besides carrying out actions: the bookkeeping that goes
    with each event (per-sample records, pool membership, step logs, checkpoints). Each returns
    whether (or with what) the orchestrator is to hear of the event."""

    def now(self) -> float: ...
    def execute(self, actions: list[Action]) -> None: ...
    def prompt_tokens(self, group_id: str) -> int: ...
    def absorb(self, ev: EngineReply) -> int | None: ...
    def sample_versions(self, sample_id: str) -> Iterable[int]: ...
    def replayed(self, sample_id: str) -> int: ...
    def turn_current(self, sample_id: str, turn: Any) -> bool: ...
    def is_current(self, instance: str, engine: Any) -> bool: ...
    def switch_landed(self, ev: SwitchDone, origin: asyncio.Task | None) -> bool: ...
    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task | None) -> bool: ...
    def register(self, ev: InstanceJoined) -> bool: ...
    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]: ...
    def write_controller_state(self, version: int, orchestrator_snapshot: dict) -> None: ...
    def step_boundary(self) -> bool: ...


# ---------------------------------------------------------------------------------------- the mapping
class EventMapping:
    """The one mapping from events to orchestrator calls, without a queue: what the controller loop
    does in a turn, and what the simulator (``sim/engine.py``) does with each event of its virtual
    clock. WHY one mapping: the simulator is to predict what ``dora train`` does, so it must feed
    the orchestrator exactly as the runtime does (the same bookkeeping hooks, the same calls, the
    end of the run decided at the same point)."""

    def __init__(self, orch: Any, executor: Executor) -> None:
        self.orch = orch
        self.executor = executor

    def step(self, event: Event, origin: asyncio.Task | None = None) -> None:
        """One turn: ``event`` -> orchestrator -> actions -> executor."""
        self.act(self.feed(event, origin))

    def act(self, actions: list[Action]) -> None:
        """Hand ``actions`` (what :meth:`feed` returned) to the executor."""
        if actions:
            self.executor.execute(actions)
            for a in actions:  # the orchestrator accounts re-prefill against the prompt's length
                if isinstance(a, Dispatch):
                    self.orch.set_prompt_tokens(a.group_id, self.executor.prompt_tokens(a.group_id))

    def feed(self, event: Event, origin: asyncio.Task | None = None) -> list[Action]:
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


# ---------------------------------------------------------------------------------------- the loop
class ControllerLoop(EventMapping):
    """Reads ``events`` until ``done`` is set; the only caller of the orchestrator's event methods
    in a run (:class:`EventMapping` is the mapping)."""

    def __init__(self, orch: Any, executor: Executor, events: EventQueue, done: asyncio.Event) -> None:
        super().__init__(orch, executor)
        self.events = events
        self.done = done

    async def run(self) -> None:
        try:
            while not self.done.is_set():
                event, fut, origin = await self.events.get()
                if fut is not None and fut.done():
                    continue  # its task was cancelled before the event was applied: withdrawn
                try:
                    self.step(event, origin)
                except BaseException as err:
                    if fut is not None and not fut.done():
                        fut.cancel()
                    raise err
                if fut is not None and not fut.done():
                    fut.set_result(None)
        finally:
            self.events.close()  # what reports from now on is never applied: its task is cancelled
