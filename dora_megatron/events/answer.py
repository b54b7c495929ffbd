"""What the runtime reads of an engine's answer to a ``/generate`` (or a KV import): one protocol.

WHY a protocol, here: an answer comes from several places that share no base class, and the
events that carry it (:class:`~dora_megatron.events.EngineReply`) sit below all of them. An engine
client answers with :class:`~dora_megatron.comm.protocol.GenerateResponse` (SGLang's client, the
vLLM adapter, the embedded engine, and a client worker's proxy, which returns the worker's
``GenerateResponse`` unpickled); a workflow's trajectory with
:class:`~dora_megatron.workflow.runner.WorkflowReply`. Both satisfy this structurally (mypy
checks each where the controller reports it), so the runtime reads typed attributes instead of
``getattr`` with a default. The events import nothing of the wire (``comm/``), hence plain
``Mapping[str, object]`` for the JSON parts (a reader narrows them first, as with ``comm.json_value.JSON``).

Members are read-only properties: a dataclass field and a property (``GenerateResponse.versions_used``)
both satisfy one, and a wider declared type (``Sequence``) accepts each implementation's lists.
"""

from __future__ import annotations

from array import array
from typing import Mapping, Protocol, Sequence


class EngineAnswer(Protocol):
    """An engine's answer as the runtime absorbs it (the tokens, their log-probs, why it ended)."""

    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def output_token_logprobs(self) -> Sequence[float] | None: ...  # None: the engine sent none
    @property
    def finish_reason(self) -> Mapping[str, object]: ...  # SGLang's ``{"type": "stop" | "length" | "abort", ...}``
    @property
    def versions_used(self) -> Sequence[str]: ...  # the weight versions that produced the tokens, in order
    @property
    def migrated(self) -> bool: ...  # exported to another instance: the import there delivers the sample
    @property
    def token_arrays(self) -> tuple[array[int], array[float]] | None: ...  # ids and log-probs pre-packed (None: not)
    @property
    def raw(self) -> Mapping[str, object]: ...  # the answer's JSON (``meta_info.routed_experts`` for routing replay)
