"""The runtime's vocabulary: the engine and trainer interfaces it drives, the run's paths, and the
records it keeps per sample and per group (a step's is the recorder's
:class:`~dora_megatron.observability.summary.StepRecord`).

Why apart from :mod:`.runtime`: these are plain data and protocols that tests, the launcher and
fakes construct directly; the runtime module keeps only the behaviour.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.data.tasks import Prompt

if TYPE_CHECKING:
    import numpy as np

    from dora_megatron.comm.routed_spool import RoutedSpool, SpooledRouted
    from dora_megatron.controller.turns import TurnGate


class Engine(Protocol):
    """The subset of :class:`~dora_megatron.comm.engine_client.EngineClient` the runtime uses."""

    # kw: routed_experts=True when routing replay is on, draft_sources with rollout.speculative=group
    # (each omitted otherwise)
    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None, *,
                       rid: str | None = None, return_logprob: bool = True, version: int | str | None = None,
                       **kw: Any) -> GenerateResponse: ...
    async def abort(self, rid: str = "", abort_all: bool = False) -> bool: ...
    async def server_info(self) -> dict[str, Any]: ...
    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> dict[str, Any]: ...
    async def supports(self, name: str) -> bool: ...
    async def export_request(self, rid: str) -> bytes: ...
    async def import_request(self, blob: bytes) -> GenerateResponse: ...
    # a trajectory's kept KV between its turns (engines that offer ``keep_kv`` only)
    async def export_kv(self, rid: str) -> bytes: ...
    async def import_kv(self, blob: bytes) -> int: ...
    async def release_kv(self, rid: str) -> bool: ...
    async def weights_checksum(self) -> str: ...
    async def add_draft_sources(self, rid: str, sources: list[list[int]]) -> bool: ...  # speculative=group only
    async def close(self) -> None: ...  # at the run's end (controller.clients.EngineClients.close)


#: one pushed load report: the engine's ``server_info`` answer, or ``("failed", why)``
LoadReport = dict[str, Any] | tuple[str, str]


class LoadReports(Protocol):
    """Load reports pushed by whoever runs the engines' clients (instead of one poll per instance)."""

    def covers(self, engine: Engine) -> bool: ...  # its reports include this engine's: the runtime does not poll it
    # engine -> its server_info answer, or ("failed", why), since the last take. The key is the
    # reporter's own client class (e.g. rollout.sharded.ProxyEngine), which the runtime holds as an
    # Engine: a dict's key type is invariant, so Engine here would refuse the reporter's narrower one
    def take_reports(self) -> dict[Any, LoadReport]: ...


class Trainer(Protocol):
    """The subset of :class:`~dora_megatron.controller.trainer_client.TrainerClient` the runtime uses
    (``push_weights`` only with ``weight_transport: distributed``; ``routed_spool`` only with
    routing replay: where finished samples' routed experts are written as they finish, None for a
    client without batch files, which copies them into the batch instead)."""

    @property
    def routed_spool(self) -> RoutedSpool | None: ...

    async def train(self, step: int, samples: list[TrainSample]) -> dict[str, Any]: ...
    async def save_checkpoint(self, path: str) -> dict[str, Any]: ...
    async def push_weights(self, engines: list[str], bucket_mb: float, master_addr: str | None = None,
                           timeout_s: float | None = None, gpus: dict[str, int] | None = None,
                           pause_mode: str | None = None, master_port: int | None = None,
                           backend: str | None = None) -> dict[str, Any]: ...


@dataclass
class SampleRecord:
    sample_id: str
    group_id: str
    index: int
    version: int
    prompt_ids: list[int]
    #: the generated tokens and the engine's log-probs of them as compact arrays (int32 ids, float32
    #: log-probs: 8 bytes a token, not ~68 as lists); named as the training sample names them
    #: (:class:`~dora_megatron.comm.train_sample.TrainSample`), in the checkpoint and the journal too
    response_ids: array[int] = field(default_factory=lambda: array("i"))
    rollout_logprobs: array[float] = field(default_factory=lambda: array("f"))
    versions: set[int] = field(default_factory=set)
    submissions: int = 0
    reward: float | None = None
    reward_error: str | None = None  # why the reward function failed (its reward is then 0), counted per step
    finished: bool = False
    task: asyncio.Task[None] | None = None
    gen_task: asyncio.Task[None] | None = None
    gen_instance: str | None = None
    replay_pending: bool = False  # restored from the journal; reported finished at its next Submit
    #: the engine's routed experts for prompt + output (routing replay): where the trainer's spool
    #: holds them (:class:`~dora_megatron.comm.routed_spool.SpooledRouted`, written when the sample
    #: finished: the controller keeps only that), or without a spool the ids themselves, flat, in
    #: the smallest integer type that holds them (:func:`~dora_megatron.comm.batch_files.compact_routed`)
    routed_experts: SpooledRouted | np.ndarray | None = None
    finish_reason: str | None = None  # the engine's finish_reason type of the answer that finished it ("stop", "length")
    loss_mask: list[int] | None = None  # a workflow's trajectory: 1 on model tokens of response_ids, 0 on the tools'
    turn: TurnGate | None = None  # a workflow's run: where its turns run, whether it was dropped


#: a finished sample's tokens and log-probs as ``controller.json`` and the journal name them
TOKEN_KEYS = ("response_ids", "rollout_logprobs")
#: what a dora before the rename wrote instead (named in the error only: such a file is not read)
_OLD_TOKEN_KEYS = {"response_ids": "output_ids", "rollout_logprobs": "logprobs"}


def entry_tokens(entry: Mapping[str, Any], where: str) -> tuple[Sequence[int], Sequence[float]]:
    """The ``response_ids`` and ``rollout_logprobs`` of a finished sample's entry in
    ``controller.json`` or the journal, as written (lists; their items are not checked one by one:
    ``array`` refuses a wrong one when the caller packs them). An entry without one (an older dora's, which wrote
    ``output_ids`` and ``logprobs``) is refused with a ``ValueError`` naming ``where`` and the key:
    a 0.1 project keeps one format, and a traceback ending in ``KeyError`` would not say which
    file is at fault."""
    for key in TOKEN_KEYS:
        if key not in entry:
            old = _OLD_TOKEN_KEYS[key]
            why = (f" but {old!r}: written by an older dora, which named a sample's tokens and log-probs "
                   f"'output_ids' and 'logprobs'; this version cannot resume from it (start a new run)"
                   if old in entry else "")
            raise ValueError(f"{where}: no {key!r}{why}")
    return entry["response_ids"], entry["rollout_logprobs"]


@dataclass
class GroupRecord:
    """What the executor needs of a dispatched group to run and train it: its prompt and sample
    ids (still needed after the orchestrator forgot the group at release). Its version and
    progress are the orchestrator's (``Orchestrator.groups``)."""

    group_id: str
    prompt: Prompt
    sample_ids: tuple[str, ...]


def instance_slots(max_running: int, cap_before_rebalance: int) -> int:
    """Requests the runtime keeps running on one instance: the engine's own cap
    (``rollout.max_running``) or the orchestrator's per-instance cap before the first rebalance
    (``orchestrator.cap_before_rebalance``), whichever is lower."""
    return min(max_running, cap_before_rebalance)


@dataclass(frozen=True)
class RunPaths:
    """Where a run's weights and checkpoints live, by version: the one value the controller's
    components need that is no config key (the launcher decides the run and model directories).

    WHY a record and not two callables: the snapshot and checkpoint layouts are the trainer's and
    the launcher's too (``RUN_DIR/weights/vNNNNNN``, ``RUN_DIR/checkpoints/vNNNNNN``); one typed
    value says them once. ``checkpoints=False``: the run writes no checkpoint, not even the final
    one (a runtime driven without a run to resume, e.g. the tests' fake fleets)."""

    run_dir: Path
    model_dir: Path  # version 0's weights (the model the run starts from)
    checkpoints: bool = True

    def snapshot_dir(self, version: int) -> str:
        """The HF weights of ``version``: the model directory for 0, the per-version snapshot after."""
        return str(self.model_dir) if version == 0 else str(self.run_dir / "weights" / f"v{version:06d}")

    def checkpoint_dir(self, version: int) -> str:
        """Checkpoint ``version``'s directory (trainer part and ``controller.json``)."""
        return str(self.run_dir / "checkpoints" / f"v{version:06d}")
