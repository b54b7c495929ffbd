"""The events both drivers feed the orchestrator: one frozen dataclass per thing that happened.

WHY a package of their own, below :mod:`dora_megatron.controller` and :mod:`dora_megatron.sim`:
``dora train`` (the asyncio runtime) and ``dora simulate`` (a virtual clock) must drive the sans-IO
:class:`~dora_megatron.orchestrator.Orchestrator` the same way, so they share these records and the
one mapping onto it (:mod:`.mapping`), and neither driver owns them (an import contract keeps the
simulator off the controller). A field typed ``object`` carries a driver's own handle (an engine
client, a turn run) that this layer and the executors only compare with what they hold. The two fields
still typed ``Any`` are handed back to the driver that made them, which reads them as its own type
(``InstanceJoined.engine``: the runtime's ``Engine``, the simulator's None; ``TrainerDone.batch``:
the runtime's ``ReleasedBatch``, the simulator's None; ``EngineReply.reward``: the runtime's
``RewardResult``): naming those types here would import the controller or the data layer, which
this layer sits below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dora_megatron.events.answer import EngineAnswer


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
    """A ``/generate`` (or KV import) answered for ``sample_id``; ``resp`` is the engine's answer
    (:class:`~dora_megatron.events.answer.EngineAnswer`; the simulator's: the answer's length in tokens).
    ``reward``: the finished sample's reward, scored off the loop by the task that got the answer
    (None: scored when the reply is applied); the controller's ``RewardResult``, opaque here as
    ``resp`` is (events import nothing of the data layer)."""

    sample_id: str
    instance: str
    resp: EngineAnswer | int
    start: float
    end: float
    reward: Any = None


@dataclass(frozen=True)
class TurnEnded:
    """A turn of ``sample_id``'s workflow returned: the trajectory is off its engine while its tool
    runs (``turn``: the run it belongs to, :class:`~dora_megatron.controller.turns.TurnGate` in a run,
    the turn's index in the simulator; compared with the sample's present one)."""

    sample_id: str
    turn: object


@dataclass(frozen=True)
class TurnReady:
    """``sample_id``'s workflow asks for its next turn (the orchestrator places it)."""

    sample_id: str
    turn: object


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
    engine: object


@dataclass(frozen=True)
class Tick:
    """The stats sweep ended: the orchestrator's timer-triggered rebalance may run."""


@dataclass(frozen=True)
class SwitchDone:
    """``instance`` loaded weights ``version`` (from disk or a trainer broadcast, ``how``)."""

    instance: str
    version: int
    engine: object
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
    engine: object = None


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
