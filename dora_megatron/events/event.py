"""The events both drivers feed the orchestrator: one frozen dataclass per thing that happened.

WHY a package of their own, below :mod:`dora_megatron.controller` and :mod:`dora_megatron.sim`:
``dora train`` (the asyncio runtime) and ``dora simulate`` (a virtual clock) must drive the sans-IO
:class:`~dora_megatron.orchestrator.Orchestrator` the same way, so they share these records and the
one mapping onto it (:mod:`.mapping`), and neither driver owns them (an import contract keeps the
simulator off the controller). Fields typed ``Any`` carry a driver's own handle (an engine client,
a turn run) that this layer only compares or hands back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    (None: scored when the reply is applied); the controller's ``RewardResult``, opaque here as
    ``resp`` is (events import nothing of the data layer)."""

    sample_id: str
    instance: str
    resp: Any
    start: float
    end: float
    reward: Any = None


@dataclass(frozen=True)
class TurnEnded:
    """A turn of ``sample_id``'s workflow returned: the trajectory is off its engine while its tool
    runs (``turn``: the run it belongs to, :class:`~dora_megatron.controller.turns.TurnGate` in a run)."""

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
    result: dict[str, Any]
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
