"""One request of the embedded engine, its weight-version spans, and the scheduler's limits.

WHY a module of its own: the scheduler (:mod:`.scheduler`), speculation (:mod:`.speculation`) and
the export format (:mod:`.export`) all read and change a :class:`Request`; holding the record
apart keeps each of them free of the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dora_megatron.comm.protocol import SamplingParams
from dora_megatron.rollout.engine.drafter import SiblingIndex, SourceDists
from dora_megatron.rollout.engine.kv_cache import RequestKV
from dora_megatron.rollout.engine.routing_trace import RoutingTrace
from dora_megatron.rollout.engine.sampled_dists import RecordRows
from dora_megatron.rollout.speculation import DraftAcceptance

DoneCallback = Callable[[dict[str, Any]], None]


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    on_done: DoneCallback | None = None
    version: str = ""
    required_version: str | None = None  # set by dora_version / import: C1 guard
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    kv: RequestKV | None = None
    reserved_blocks: int = 0
    migrations: int = 0
    created: float = field(default_factory=time.monotonic)
    #: (old version, output tokens made so far) at each weight change the request lived through
    version_changes: list[tuple[str, int]] = field(default_factory=list)
    routing: RoutingTrace | None = None  # set when the request asks for return_routed_experts
    #: token ids (prompt + output) of the group's finished siblings: drafts for speculative=group
    draft_sources: list[list[int]] = field(default_factory=list)
    #: the sources' token positions, for sampled drafts; built on first use, dropped when they change
    draft_index: SiblingIndex | None = None
    #: each source's scored distributions (``spec_sibling_top_k``), None until scored; kept
    #: aligned with ``draft_sources`` while sources come and go, never exported (the importing
    #: instance scores them again)
    draft_dists: list[SourceDists | None] = field(default_factory=list)
    #: per step, the distributions its output tokens were drawn from (top ``spec_sibling_top_k``:
    #: ids, probs), kept for its siblings when it finishes (:mod:`.sampled_dists`); None: not
    #: recorded (greedy, no ``group`` speculation, migrated in, or across a weight change)
    sampled: RecordRows | None = None
    #: the request's draft acceptance evidence: the speculation policy's per-request input
    spec_acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)
    #: ``dora_keep_kv``: when it finishes, its KV stays here for the next turn of its trajectory
    keep_kv: bool = False
    #: KV positions that hold the request's own tokens after a verify step (rejected draft
    #: positions past it); None: all of them
    kv_valid: int | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def weight_version_spans(changes: list[tuple[str, int]], current: str, num_output: int) -> list[dict[str, Any]]:
    """``meta_info.weight_versions`` as SGLang (>= 0.5.22) reports it: consecutive output-token
    spans ``{"version", "start", "end"}``, one per version that produced tokens (a request with
    no output yet: one empty span of the current version)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*changes, (current, num_output)]:
        end = min(end, num_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int = 32
    block_size: int = 16
    kv_blocks: int | None = None  # None: enough for max_running full-context requests
    max_context: int | None = None  # None: the model's max_position_embeddings
    max_waiting: int | None = 4096  # queued (not yet running) requests; more get 429. None: unbounded
    speculative: str = "off"  # rollout.speculative: off | ngram | group
    spec_tokens: int = 4  # rollout.spec_tokens: draft length k
    spec_max_batch: int = 8  # rollout.spec_max_batch: speculate only at running batches up to this
    spec_token_cost: float = 0.25  # rollout.spec_token_cost: a draft token's cost relative to a decode step
    spec_probe_interval: int = 64  # rollout.spec_probe_interval: decode steps between probes of a non-drafter
    spec_sibling_top_k: int = 32  # rollout.spec_sibling_top_k: tokens kept per scored sibling position (0: counts)
    kept_kv_s: float = 60.0  # how long a finished turn's KV (dora_keep_kv) waits for the trajectory's next turn
    kept_kv_fraction: float = 0.25  # the share of the KV blocks kept turns may hold together
