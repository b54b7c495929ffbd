"""The runtime's vocabulary: the engine and trainer interfaces it drives, its options, and the
records it keeps per sample and per group (a step's is the recorder's
:class:`~dora_megatron.observability.summary.StepRecord`).

Why apart from :mod:`.runtime`: these are plain data and protocols that tests, the launcher and
fakes construct directly; the runtime module keeps only the behaviour.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.data.tasks import Prompt


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


class LoadReports(Protocol):
    """Load reports pushed by whoever runs the engines' clients (instead of one poll per instance)."""

    def covers(self, engine: Any) -> bool: ...  # its reports include this engine's: the runtime does not poll it
    def take_reports(self) -> dict[Any, Any]: ...  # engine -> server_info dict or ("failed", why), since the last take


class Trainer(Protocol):
    """The subset of :class:`~dora_megatron.controller.trainer_client.TrainerClient` the runtime uses
    (``push_weights`` only with ``weight_transport: distributed``)."""

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
    routed_experts: Any = None
    finish_reason: str | None = None  # the engine's finish_reason type of the answer that finished it ("stop", "length")
    loss_mask: list[int] | None = None  # a workflow's trajectory: 1 on model tokens of response_ids, 0 on the tools'
    turn: Any = None  # a workflow's run (controller.turns.TurnGate): where its turns run, whether it was dropped


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


@dataclass
class RuntimeOptions:
    """What the runtime reads of the config, filled from each owning section by
    :func:`~dora_megatron.controller.build.runtime_options`.

    WHY the defaults name the config: each default is owned once, by the config section's field
    (``field_doc``, documented in docs/configuration.md); the defaults here read it, so a test or
    tool that builds options by hand runs with what ``dora train`` would (and
    tests/unit/controller/test_runtime_options.py checks they agree field by field)."""

    steps: int
    seed: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    snapshot_dir: Callable[[int], str]  # version -> HF snapshot directory
    stats_interval_s: float = ObservabilityConfig.stats_interval_s
    stats_concurrency: int = 64  # stats polls in flight at once during one sweep (not a config key)
    slots_per_instance: int = instance_slots(RolloutConfig.max_running, OrchestratorConfig.cap_before_rebalance)
    request_timeout_s: float = RolloutConfig.request_timeout_s
    health_timeout_s: float = ControllerConfig.health_timeout_s
    verify_checksums: bool = ControllerConfig.verify_checksums
    # "kv": export/import when both engines offer it; "reprefill": abort + resubmit
    migration: str = ControllerConfig.migration
    # "distributed": the trainer broadcasts the newest version to switching engines
    weight_transport: str = ControllerConfig.weight_transport
    push: PushOptions = field(default_factory=PushOptions)  # how the trainer broadcasts (distributed transport)
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end a sample (the codec's EOS always does)
    # one instance's weight update; slower = the instance failed
    weight_sync_timeout_s: float = ControllerConfig.weight_sync_timeout_s
    checkpoint_interval: int = RunConfig.checkpoint_interval  # steps; 0 = only at the end
    checkpoint_dir: Callable[[int], str] | None = None  # version -> checkpoint directory (None: no checkpoints)
    # a stop request waits this long for the next step boundary
    stop_checkpoint_timeout_s: float = ControllerConfig.stop_checkpoint_timeout_s
    routed_experts: bool = False  # ask engines for routed experts and hand them to the trainer (algo.routing_replay)
    draft_siblings: bool = False  # send each request its group's finished siblings (rollout.speculative=group)
    # push them only to instances running at most this many (0: always)
    draft_push_max_batch: int = RolloutConfig.spec_max_batch

