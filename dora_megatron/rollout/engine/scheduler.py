"""Continuous-batching scheduler: the single-threaded core of an embedded engine instance.

Why single-threaded and I/O-free: every mutation of requests, KV caches and weights happens in
one thread (the runner's), between forward steps, so there are no locks around model state and
the logic can be unit-tested by calling :meth:`Scheduler.step` directly.

Each :meth:`step` admits waiting requests (FIFO) while the running count is below
``max_running`` and KV blocks can be reserved, then runs ONE ragged forward over every running
request: requests that need a prefill contribute all their uncached tokens, the others their
last token, so requests join and leave the batch at every step. Finished requests release their
KV blocks and their ``on_done`` callback receives the SGLang-shaped response dict.

A request's KV holds every token except the last sampled one; the next step feeds that token.
This invariant is what export/import carry, so a migrated request continues without re-prefill.

Speculative decoding (``SchedulerLimits.speculative``): while
:func:`~dora_megatron.rollout.speculation.should_speculate` allows it for the running batch, a
decoding request feeds its last token plus a draft of up to ``spec_tokens`` tokens
(:mod:`~dora_megatron.rollout.engine.drafter`) in the same ragged forward; the draft is verified
by :func:`~dora_megatron.rollout.engine.sampler.verify_draft`, and the KV positions of rejected
draft tokens are dropped again, so the invariant above holds after every step and the blocks a
request reserved at admission still bound its cache (a draft never reaches past the request's
remaining token budget).
"""

from __future__ import annotations

import io
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from dora_megatron.rollout.engine.drafter import (
    SiblingIndex,
    SourceDists,
    propose_draft,
    sample_sibling_draft,
    sibling_source,
)
from dora_megatron.rollout.engine.kept_kv import KeptKV
from dora_megatron.rollout.engine.kv_cache import BlockPool, RequestKV, blocks_for
from dora_megatron.rollout.engine.model import CausalLM
from dora_megatron.rollout.engine.routing_trace import RoutingTrace, split_step_routing
from dora_megatron.rollout.engine.sampler import DraftLaw, make_generator, sample_token, verify_draft
from dora_megatron.rollout.engine.sampled_dists import RecordRows, SampledDists, SampledRecord, record_dists
from dora_megatron.rollout.engine.sibling_scores import score_sources, scoring_lengths, top_dists
from dora_megatron.rollout.speculation import (
    DraftAcceptance,
    observe_decode,
    observe_verify,
    plan_draft,
    should_speculate,
)
from dora_megatron.comm.protocol import (
    ProtocolError,
    SamplingParams,
    finish_abort,
    finish_length,
    finish_stop,
)

log = logging.getLogger(__name__)

EXPORT_FORMAT = "dora-request-v1"
KV_EXPORT_FORMAT = "dora-kept-kv-v1"
#: sibling sequences a request keeps for drafting (the newest); a group is rarely larger, and each
#: source costs a scan per verify step
MAX_DRAFT_SOURCES = 16
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


@dataclass
class SpecStats:
    """What speculation did on this instance (cumulative): verify steps count per request."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens kept
    verify_tokens: int = 0  # tokens the verify steps yielded (kept drafts + the verify pass's own)
    declined_steps: int = 0  # decode steps of requests the policy let speculate but whose drafts do not pay
    scored_tokens: int = 0  # sibling tokens the scoring forwards computed (spec_sibling_top_k)
    recorded_sources: int = 0  # sibling sources whose distributions this instance kept from sampling them

    def info(self) -> dict[str, Any]:
        v = self.verify_steps
        return {"spec_verify_steps": v, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_verify_tokens": self.verify_tokens,
                "spec_declined_steps": self.declined_steps, "spec_scored_tokens": self.scored_tokens,
                "spec_recorded_sources": self.recorded_sources,
                "spec_accepted_per_step": self.accepted_tokens / v if v else 0.0,
                "spec_accept_length": self.verify_tokens / v if v else 0.0}


class Drafter(Protocol):
    """Proposes up to ``k`` draft tokens to follow ``context`` (see :func:`propose_draft`)."""

    def __call__(self, context: Sequence[int], k: int, sources: Sequence[Sequence[int]]) -> list[int]: ...


class Scheduler:
    def __init__(self, model: CausalLM, limits: SchedulerLimits, weight_version: str = "0",
                 drafter: Drafter = propose_draft) -> None:
        self.model = model
        self.drafter = drafter
        self.limits = limits
        self.max_context = int(limits.max_context or model.config.max_position_embeddings)
        self.block_size = int(limits.block_size)
        total = limits.kv_blocks or limits.max_running * blocks_for(self.max_context, self.block_size)
        self.pool = BlockPool(total)
        self.kept = KeptKV(self.pool, int(limits.block_size), int(total * limits.kept_kv_fraction), limits.kept_kv_s)
        #: finished requests' sampled distributions, for their siblings' drafts: as many rows as the pool holds tokens
        self.sampled = SampledDists(total * self.block_size)
        self.tokens_computed = 0  # the requests' own token positions whose KV this instance computed
        self.kv_shape = model.kv_shape(self.block_size)
        self.weight_version = str(weight_version)
        self.eos_ids = set(model.config.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.paused: str | None = None
        self.hold_admission = False
        self.steps = 0
        self.tokens_generated = 0
        self.spec = SpecStats()
        should_speculate(limits.speculative, 0, limits.spec_max_batch)  # refuses an unknown mode now
        self._checksum: str | None = None

    # ---- submission ----------------------------------------------------------------------
    def check_version(self, version: str | None) -> None:
        if version is not None and str(version) != self.weight_version:
            raise ProtocolError(
                f"request needs weight version {version} but this instance holds version {self.weight_version}", 409
            )

    def submit(self, req: Request, required_version: str | None = None) -> None:
        """Queue a new request; raises ProtocolError (4xx) for a request that cannot run here."""
        self.check_version(required_version)
        if req.rid in self.by_rid:
            raise ProtocolError(f"rid {req.rid!r} is already in use on this instance")
        if len(req.prompt_ids) >= self.max_context:
            raise ProtocolError(
                f"prompt has {len(req.prompt_ids)} tokens; the context length is {self.max_context} "
                "(prompt must be shorter to generate at least one token)"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in req.prompt_ids if t < 0 or t >= vocab]
        if bad:
            raise ProtocolError(f"input_ids contain ids outside [0, {vocab}): {bad[:5]}")
        bad = [t for src in req.draft_sources for t in src if t < 0 or t >= vocab]
        if bad:  # drafts are fed to the model: an id outside the vocabulary would fail the batch
            raise ProtocolError(f"dora_draft_sources contain ids outside [0, {vocab}): {bad[:5]}")
        req.draft_sources = [sibling_source(req.prompt_ids, src) for src in req.draft_sources[-MAX_DRAFT_SOURCES:]]
        req.draft_dists = [None] * len(req.draft_sources)
        req.draft_index = None
        if self._blocks_needed(req) > self.pool.total:
            raise ProtocolError(f"request needs more KV blocks than this instance has ({self.pool.total})")
        queued = len(self.waiting) + len(self.held)
        if self.limits.max_waiting is not None and queued >= self.limits.max_waiting:
            raise ProtocolError(
                f"engine overloaded: {queued} requests already queued (max_waiting {self.limits.max_waiting}); retry later",
                429,
            )
        if req.routing is not None and not 0 <= req.routing.start_len <= len(req.prompt_ids):
            raise ProtocolError(f"routed_experts_start_len {req.routing.start_len} must be in [0, "
                                f"{len(req.prompt_ids)}] (the prompt length)")
        req.version = self.weight_version
        req.required_version = None if required_version is None else str(required_version)
        if req.kv is None and req.routing is None:  # its trajectory's last turn left its KV here: only what follows is computed
            req.kv = self.kept.take(req.rid, req.prompt_ids, self.weight_version)
        if req.generator is None:
            req.generator = make_generator(req.params.sampling_seed)
        lim = self.limits
        req.sampled = RecordRows() if lim.speculative == "group" and lim.spec_sibling_top_k > 0 and not req.params.greedy else None
        self.by_rid[req.rid] = req
        if req.params.max_new_tokens == 0:
            self._finish(req, finish_length(0))
            return
        (self.held if self.hold_admission else self.waiting).append(req)

    def add_draft_sources(self, rid: str, sources: list[list[int]]) -> bool:
        """Let request ``rid`` draft from more token sequences (its group's siblings that finished
        after it was submitted); False when it is not here (finished, aborted, migrated)."""
        r = self.by_rid.get(rid)
        if r is None:
            return False
        vocab = self.model.config.vocab_size
        bad = [t for src in sources for t in src if not 0 <= t < vocab]
        if bad:  # drafts are fed to the model: an id outside the vocabulary would fail the batch
            raise ProtocolError(f"sources contain ids outside [0, {vocab}): {bad[:5]}")
        r.draft_sources.extend(sibling_source(r.prompt_ids, src) for src in sources)
        r.draft_dists.extend([None] * len(sources))
        del r.draft_sources[:-MAX_DRAFT_SOURCES]
        del r.draft_dists[:-MAX_DRAFT_SOURCES]
        r.draft_index = None
        return True

    def _blocks_needed(self, req: Request) -> int:
        remaining = req.params.max_new_tokens - len(req.output_ids)
        return blocks_for(min(len(req.tokens) + max(remaining, 0), self.max_context), self.block_size)

    # ---- stepping ------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    def can_step(self) -> bool:
        return self.paused is None and bool(self.running or self.waiting)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_running:
            req = self.waiting[0]
            need = self._blocks_needed(req)
            self.kept.free_for(need)  # kept turns never delay new work
            if not self.pool.can_reserve(need):
                break
            self.waiting.popleft()
            self.pool.reserve(need)
            req.reserved_blocks = need
            if req.kv is None:
                req.kv = RequestKV(self.kv_shape)
            self.running.append(req)

    @torch.inference_mode()
    def step(self) -> int:
        """Admit, run one forward over all running requests, sample; return tokens produced."""
        if self.paused is not None:
            return 0
        self._admit()
        if not self.running:
            return 0
        batch = list(self.running)
        lim = self.limits
        speculate = should_speculate(lim.speculative, len(batch), lim.spec_max_batch)
        ids: list[int] = []
        pos: list[int] = []
        segs = []
        drafts: list[list[int]] = []
        draft_qs: list[list[DraftLaw] | None] = []
        for r in batch:
            toks = r.tokens
            start = r.kv.length
            draft, q = self._draft(r) if speculate and len(toks) - start == 1 else ([], None)
            draft_qs.append(q)
            new = toks[start:] + draft
            self.tokens_computed += len(toks) - start
            r.kv.ensure_capacity(start + len(new))
            ids.extend(new)
            pos.extend(range(start, start + len(new)))
            segs.append((r.kv, len(new)))
            drafts.append(draft)
            if r.routing is not None:
                r.routing.truncate(start)  # a retracted request re-prefills: its rows are recomputed
        dev = self.kv_shape.device
        routing_out: dict[int, torch.Tensor] | None = {} if any(r.routing is not None for r in batch) else None
        hidden = self.model.forward_segments(
            torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), segs,
            routing_out,
        )
        if routing_out is not None:
            c = self.model.config
            for r, rows in zip(batch, split_step_routing(routing_out, [m for _, m in segs], c.num_layers, c.top_k)):
                if r.routing is not None:
                    r.routing.append(rows)
        # the rows that predict: each request's last position, plus its draft positions when it has one
        rows_of: list[int] = []
        end = 0
        for (_, m), draft in zip(segs, drafts):
            end += m
            rows_of.extend(range(end - 1 - len(draft), end))
        logits = self.model.logits(hidden[torch.tensor(rows_of, device=dev)]).float()
        recorded = self._step_records(batch, drafts, logits)  # on the logits' device: only [rows, K] moves
        logits = logits.cpu()
        produced, row = 0, 0
        for b, (r, draft, q) in enumerate(zip(batch, drafts, draft_qs)):
            own = logits[row : row + len(draft) + 1]
            row += len(draft) + 1
            try:
                if draft:
                    toks, lps = verify_draft(own, draft, r.params, r.generator, q)
                else:
                    tok, lp = sample_token(own[0], r.params, r.generator)
                    toks, lps = [tok], [lp]
            except Exception as exc:  # noqa: BLE001 - one request's bad sample must not fail the batch
                log.exception("sampling failed for request %s", r.rid)
                self._finish(r, finish_abort(f"sampling failed: {exc!r}", 500, "internal_error"))
                continue
            rec = None if recorded is None else recorded[b]
            if r.sampled is not None and rec is not None:  # row i: what toks[i] was drawn from
                r.sampled.append(rec[0][: len(toks)], rec[1][: len(toks)])
            produced += self._take(r, toks, lps, draft)
        self.steps += 1
        self.tokens_generated += produced
        return produced

    def _step_records(self, batch: list[Request], drafts: list[list[int]], logits: torch.Tensor
                      ) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """Per request of the batch, the top ``spec_sibling_top_k`` of each of its predicting rows'
        sampling distributions (``logits`` has its rows in batch order, ``len(draft) + 1`` each)
        when it records them, else None; None when none does. Batched over the recording rows
        only (on the logits' device: only ``[rows, K]`` moves)."""
        spans: list[tuple[int, int] | None] = []
        rows: list[int] = []
        params: list[SamplingParams] = []
        at = 0
        for r, draft in zip(batch, drafts):
            n = len(draft) + 1
            spans.append((len(rows), n) if r.sampled is not None else None)
            if r.sampled is not None:
                rows.extend(range(at, at + n))
                params.extend([r.params] * n)
            at += n
        if not rows:
            return None
        picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        ids, probs = top_dists(picked, params, self.limits.spec_sibling_top_k)
        ids, probs = ids.cpu(), probs.cpu()
        return [None if sp is None else (ids[sp[0] : sp[0] + sp[1]], probs[sp[0] : sp[0] + sp[1]]) for sp in spans]

    def _draft(self, r: Request) -> tuple[list[int], list[DraftLaw] | None]:
        """The draft of a decoding request, and the distributions its tokens were drawn from (None:
        chosen deterministically): at most ``spec_tokens``, short enough that the verify pass's
        tokens fit the request's remaining budget and the context, and as long as the request's
        acceptance estimate says pays (:func:`~dora_megatron.rollout.speculation.plan_draft`).

        ``group`` at a temperature above zero draws the draft from the siblings
        (:func:`~dora_megatron.rollout.engine.drafter.sample_sibling_draft`), which the verify
        rule keeps more often than a fixed guess, and drafts nothing where no sibling matches: the
        fixed guess of the request's own text is kept with probability p(guess) only, which does
        not pay for its verify positions at temperature 1 (docs/results/speculation.md). Greedy
        requests keep the deterministic drafter (a sibling's greedy answer is the same text:
        copying it verbatim is kept whole)."""
        lim = self.limits
        room = min(lim.spec_tokens, r.params.max_new_tokens - len(r.output_ids) - 1, self.max_context - len(r.tokens) - 1)
        k = plan_draft(r.spec_acceptance, room, lim.spec_token_cost, lim.spec_probe_interval, len(self.running))
        if room > 0 and k == 0:
            self.spec.declined_steps += 1
        draft: list[int] = []
        q: list[DraftLaw] | None = None
        sampled = lim.speculative == "group" and not r.params.greedy
        if k > 0 and sampled and r.draft_sources:
            try:
                draft, q = sample_sibling_draft(r.tokens, k, self._sibling_index(r), r.generator)
            except Exception:  # noqa: BLE001 - a draft sets speed only: it must never fail the batch
                log.exception("drafting for request %s failed; it decodes without a draft this step", r.rid)
                draft, q = [], None
        if k > 0 and not draft and not sampled:
            draft, q = self.drafter(r.tokens, k, r.draft_sources if lim.speculative == "group" else ()), None
        if not draft:  # a plain decode step: it times the request's next probe
            r.spec_acceptance = observe_decode(r.spec_acceptance)
        return draft, q

    def _sibling_index(self, r: Request) -> SiblingIndex:
        """The request's :class:`SiblingIndex`, built once per set of sources: with the sources'
        scored distributions (``spec_sibling_top_k`` above zero) when every source is scored,
        scoring the ones that are not while the KV pool has the blocks for it; with the counts
        otherwise (until the sources change again)."""
        if r.draft_index is not None:
            return r.draft_index
        top_k = self.limits.spec_sibling_top_k
        for i, d in enumerate(r.draft_dists):
            if d is None and top_k > 0:
                r.draft_dists[i] = self.sampled.source_dists(r.prompt_ids, r.draft_sources[i])
                self.spec.recorded_sources += r.draft_dists[i] is not None
        todo = [i for i, d in enumerate(r.draft_dists) if d is None]
        if top_k > 0 and todo:
            self._score(r, todo, top_k)
        dists = [d for d in r.draft_dists if d is not None]
        r.draft_index = SiblingIndex(r.draft_sources, dists=dists if top_k > 0 and len(dists) == len(r.draft_sources) else None)
        return r.draft_index

    def _score(self, r: Request, todo: list[int], top_k: int) -> None:
        """Score ``r``'s sources ``todo`` (:func:`score_sources`) when the KV pool has the blocks
        for it, and keep each as a record for the other requests of its group here. A failure (the
        device out of memory, say) leaves them unscored: drafts set speed, never tokens, so it
        must not fail the batch."""
        sources = [r.draft_sources[i] for i in todo]
        lengths = scoring_lengths(r.prompt_ids, sources)
        if r.kv is None or not self.pool.can_reserve(sum(blocks_for(n, self.block_size) for n in lengths)):
            return
        try:
            dists, computed = score_sources(self.model, r.kv, r.prompt_ids, sources, r.params, top_k)
        except (RuntimeError, ValueError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            log.warning("scoring %d sibling sources of request %s failed; it drafts from their tokens: %s",
                        len(sources), r.rid, exc)
            return
        self.spec.scored_tokens += computed
        n_prompt = len(r.prompt_ids)
        for i, d in zip(todo, dists):
            r.draft_dists[i] = d
            if d.start > 0 and len(r.draft_sources[i]) > n_prompt - d.start:  # the same prompt, and an answer
                # the rows after its prompt are its record: kept for the group's other requests
                # (unless this request's own KV may hold other weights: it lived through a load or
                # came from another instance), and drafted from as a record is, whichever instance
                first = n_prompt - 1 - d.start
                seq = r.prompt_ids[: d.start] + r.draft_sources[i]
                rec = SampledRecord(n_prompt, d.ids[first:-1], d.probs[first:-1])
                if r.sampled is not None:
                    self.sampled.keep(seq, rec)
                r.draft_dists[i] = record_dists(rec, seq, d.start)

    def _take(self, r: Request, toks: list[int], lps: list[float], draft: list[int]) -> int:
        """Append a step's tokens to ``r`` up to the first that ends it; with a draft, drop the KV
        of the rejected draft positions. Returns the tokens kept."""
        kept = 0
        if draft:  # the KV of a draft position is the request's own only up to the first rejection
            lead = next((i for i, (t, d) in enumerate(zip(toks, draft)) if t != d), min(len(toks), len(draft)))
            r.kv_valid = len(r.tokens) + lead
        for tok, lp in zip(toks, lps):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            kept += 1
            reason = self._finish_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
                break
        if draft:
            accepted = next((i for i, (t, d) in enumerate(zip(toks[:kept], draft)) if t != d), min(kept, len(draft)))
            r.spec_acceptance = observe_verify(r.spec_acceptance, len(draft), accepted, rejected=accepted < min(kept, len(draft)))
            self.spec.verify_steps += 1
            self.spec.draft_tokens += len(draft)
            self.spec.accepted_tokens += accepted
            self.spec.verify_tokens += kept
            r.kv_valid = None
            if r.kv is not None:  # still running: its KV must end before its last token again
                r.kv.truncate(len(r.tokens) - 1)
                if r.routing is not None:
                    r.routing.truncate(r.kv.length)
        return kept

    def _finish_reason(self, r: Request, tok: int) -> dict[str, Any] | None:
        if tok in r.params.stop_token_ids or (tok in self.eos_ids and not r.params.ignore_eos):
            return finish_stop(tok)
        if len(r.output_ids) >= r.params.max_new_tokens:
            return finish_length(r.params.max_new_tokens)
        if len(r.tokens) >= self.max_context:
            return finish_length(len(r.output_ids))
        return None

    def _remove(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        elif r in self.held:
            self.held.remove(r)
        self.pool.release(r.reserved_blocks)
        r.reserved_blocks = 0
        r.kv = None
        self.by_rid.pop(r.rid, None)

    def _finish(self, r: Request, reason: dict[str, Any], migrated: bool = False) -> None:
        kv = r.kv if r.keep_kv and reason.get("type") in ("stop", "length") else None
        if r.sampled is not None and reason.get("type") in ("stop", "length") and r.sampled.n:
            ids, probs = r.sampled.rows()
            n = len(r.output_ids)
            self.sampled.keep(r.tokens, SampledRecord(len(r.prompt_ids), ids[:n], probs[:n]))
        r.sampled = None
        self._remove(r)
        if kv is not None:
            valid = min(kv.length, len(r.tokens) - 1, r.kv_valid if r.kv_valid is not None else kv.length)
            kv.truncate(valid)
            self.kept.keep(r.rid, r.tokens, kv, self.weight_version)
        if r.on_done is not None:
            r.on_done(self.response(r, reason, migrated))

    def response(self, r: Request, reason: dict[str, Any], migrated: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "weight_versions": weight_version_spans(r.version_changes, self.weight_version, len(r.output_ids)),
            "e2e_latency": time.monotonic() - r.created,
            "dora_version": r.version,
            "dora_migrations": r.migrations,
            "dora_migrated": migrated,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)]
        if r.routing is not None:
            meta["routed_experts"] = r.routing.encode(len(r.tokens) - 1)
        return {"output_ids": list(r.output_ids), "meta_info": meta}

    # ---- control -------------------------------------------------------------------------
    def _match(self, rid: str, abort_all: bool) -> list[Request]:
        reqs = list(self.running) + list(self.waiting) + list(self.held)
        if abort_all:
            return reqs
        exact = [r for r in reqs if r.rid == rid]
        return exact or [r for r in reqs if r.rid.startswith(rid)]

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Abort request") -> int:
        """Abort request ``rid``, or all; return the count.

        An exact rid match aborts only that request; otherwise every request whose rid starts
        with ``rid`` is aborted (SGLang's prefix match). The exact-first rule keeps ``abort("s1")``
        from also aborting ``"s10"``.
        """
        matched = self._match(rid, abort_all)
        for r in matched:
            self._finish(r, finish_abort(message))
        return len(matched)

    def fail_running(self, message: str) -> int:
        """Finish every running request with an internal-error abort (after a failed step)."""
        reqs = list(self.running)
        for r in reqs:
            self._finish(r, finish_abort(message, 500, "internal_error"))
        return len(reqs)

    def pause(self, mode: str) -> int:
        """SGLang's pause modes; returns the number of affected requests."""
        if mode == "abort":
            n = self.abort(abort_all=True, message="Aborted by pause_generation(mode=abort)")
        elif mode == "retract":
            n = len(self.running)
            for r in reversed(self.running):
                self.pool.release(r.reserved_blocks)
                r.reserved_blocks = 0
                r.kv = None
                self.waiting.appendleft(r)
            self.running = []
        elif mode == "in_place":
            n = len(self.running)
        else:
            raise ProtocolError(f"unknown pause mode {mode!r}")
        self.paused = mode
        return n

    def resume(self) -> None:
        self.paused = None

    def release_held(self) -> None:
        self.hold_admission = False
        self.waiting.extend(self.held)
        self.held = []

    def flush_cache(self) -> None:
        """No prefix cache to flush; refuses while requests are queued or running (as SGLang)."""
        if self.running or self.waiting:
            raise ProtocolError(
                f"cannot flush cache with {len(self.running)} running and {len(self.waiting)} waiting requests"
            )

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, tensors: dict[str, torch.Tensor], version: str | None, require_all: bool) -> None:
        """Validate then copy weights (all or nothing); set the version only on success."""
        try:
            self.model.load_weights(tensors, require_all=require_all)
        except ValueError as exc:
            raise ProtocolError(f"weights rejected, old weights kept: {exc}") from None
        self._checksum = None
        self.sampled.clear()  # drawn from the old weights: siblings of new requests would score them again
        for r in list(self.running) + list(self.waiting) + list(self.held):
            if r.output_ids:
                r.sampled = None  # its record would mix two sets of weights
            r.draft_dists = [None] * len(r.draft_sources)  # scored with the old weights
            r.draft_index = None
        if version is not None and str(version) != self.weight_version:
            self.kept.clear()  # computed with the old weights (C1)
            old, self.weight_version = self.weight_version, str(version)
            self._abort_version_bound(old)
            for r in list(self.running) + list(self.waiting) + list(self.held):
                if r.output_ids:
                    r.version_changes.append((old, len(r.output_ids)))

    def _abort_version_bound(self, old: str) -> None:
        """C1: a request pinned to a version must not continue on other weights (paused updates)."""
        for r in list(self.running) + list(self.waiting) + list(self.held):
            if r.required_version is not None and r.required_version != self.weight_version:
                msg = f"weights changed from version {old} to {self.weight_version}; request requires {r.required_version}"
                self._finish(r, finish_abort(msg, 409, "version_changed"))

    def weights_checksum(self) -> str:
        from dora_megatron.comm.checksum import weights_checksum

        if self._checksum is None:
            self._checksum = weights_checksum(self.model.hf_state_dict())
        return self._checksum

    # ---- migration -----------------------------------------------------------------------
    def export_request(self, rid: str) -> bytes:
        """Remove request ``rid`` from this instance and serialise it (state, KV, RNG state).

        Its pending ``/generate`` answers with ``finish_reason.type == "abort"``,
        ``err_type == "migrated"`` and ``meta_info.dora_migrated == true``.
        """
        r = self.by_rid.get(rid)
        if r is None:
            raise ProtocolError(f"unknown rid {rid!r}", 404)
        blob = {
            "format": EXPORT_FORMAT,
            "rid": r.rid,
            "prompt_ids": list(r.prompt_ids),
            "output_ids": list(r.output_ids),
            "output_logprobs": list(r.output_logprobs),
            "params": r.params.to_json(),
            "return_logprob": r.return_logprob,
            "version": r.version,
            "migrations": r.migrations + 1,
            "rng_state": r.generator.get_state(),
            "kv": r.kv.export_tensor() if r.kv is not None and r.kv.length else None,
            "model": self._model_shape(),
            "routing": r.routing.export() if r.routing is not None else None,
            "draft_sources": [list(x) for x in r.draft_sources],
            "spec_acceptance": r.spec_acceptance.to_json(),
            "keep_kv": r.keep_kv,
        }
        buf = io.BytesIO()
        torch.save(blob, buf)
        self._finish(r, finish_abort("migrated to another instance", 200, "migrated"), migrated=True)
        return buf.getvalue()

    def import_request(self, data: bytes, on_done: DoneCallback | None) -> Request:
        """Queue an exported request (first in line); it continues from its KV without re-prefill."""
        blob = self._load_export(data, EXPORT_FORMAT, "request")
        c = self.model.config
        req = self._request_from_blob(blob, on_done)
        req.draft_dists = [None] * len(req.draft_sources)  # scores are not exported: scored here again
        self.check_version(req.required_version)
        if req.rid in self.by_rid:
            raise ProtocolError(f"rid {req.rid!r} is already in use on this instance", 409)
        if len(req.tokens) >= self.max_context or len(req.output_ids) >= req.params.max_new_tokens:
            raise ProtocolError(f"exported request has {len(req.tokens)} tokens; nothing left to generate here")
        if self._blocks_needed(req) > self.pool.total:
            raise ProtocolError(f"request needs more KV blocks than this instance has ({self.pool.total})")
        kv = blob.get("kv")
        if kv is not None:
            if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or kv.device.type != "cpu":
                raise ProtocolError("kv must be a dense CPU tensor")
            if not kv.is_floating_point():
                raise ProtocolError("kv must be a floating-point tensor")
            try:
                req.kv = RequestKV.from_tensor(self.kv_shape, kv)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if req.kv.length >= len(req.tokens):
                raise ProtocolError("exported KV covers more tokens than the request has")
        if blob.get("routing") is not None:
            req.routing = RoutingTrace.from_export(blob["routing"], c.num_layers, c.top_k, c.num_experts,
                                                   req.kv.length if req.kv is not None else 0)
        self.by_rid[req.rid] = req
        (self.held if self.hold_admission else self.waiting).appendleft(req)
        return req

    def export_kept(self, rid: str) -> bytes:
        """Remove the kept KV of ``rid`` (its trajectory's last turn) and serialise it for
        :meth:`import_kept` on another instance of the version; 404 when none is kept."""
        e = self.kept.pop(rid)
        if e is None:
            raise ProtocolError(f"no kept KV for rid {rid!r}", 404)
        buf = io.BytesIO()
        torch.save({"format": KV_EXPORT_FORMAT, "rid": rid, "tokens": e.tokens, "version": e.version,
                    "kv": e.kv.export_tensor(), "model": self._model_shape()}, buf)
        return buf.getvalue()

    def _model_shape(self) -> list[int]:
        """What an export names of the model its KV fits (an import checks it)."""
        c = self.model.config
        return [c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size]

    def _load_export(self, data: bytes, fmt: str, what: str) -> dict[str, Any]:
        """An export's body (untrusted input) as a dict of format ``fmt`` for this model's shape."""
        try:
            blob = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's fault
            raise ProtocolError(f"body is not an exported {what}: {str(exc)[:200]}") from None
        if not isinstance(blob, dict) or blob.get("format") != fmt:
            raise ProtocolError(f"body is not a {fmt} export")
        shape = blob.get("model")
        if not isinstance(shape, list) or shape != self._model_shape():
            raise ProtocolError(f"exported {what} is for a different model shape {str(shape)[:80]}")
        return blob

    def import_kept(self, data: bytes) -> int:
        """Keep the KV :meth:`export_kept` serialised for its trajectory's next turn here; returns
        the tokens it covers. 409 for KV of other weights than this instance holds (C1); 507 when
        the kept budget has no room for it."""
        blob = self._load_export(data, KV_EXPORT_FORMAT, "KV")
        c = self.model.config
        rid, tokens, version, kv = blob.get("rid"), blob.get("tokens"), blob.get("version"), blob.get("kv")
        if not isinstance(rid, str) or not rid:
            raise ProtocolError("rid must be a non-empty string")
        self.check_version(version if isinstance(version, str) else None)
        if not isinstance(version, str):
            raise ProtocolError("version must be a string")
        vocab = c.vocab_size
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                                               for t in tokens):
            raise ProtocolError(f"tokens must be a list of token ids in [0, {vocab})")
        if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or not kv.is_floating_point():
            raise ProtocolError("kv must be a dense floating-point tensor")
        try:
            req_kv = RequestKV.from_tensor(self.kv_shape, kv)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if req_kv.length != len(tokens) or not tokens or len(tokens) >= self.max_context:
            raise ProtocolError(f"the KV covers {req_kv.length} tokens, the export names {len(tokens)}")
        if not self.kept.keep(rid, tokens, req_kv, version):
            raise ProtocolError(f"no room to keep {len(tokens)} tokens of KV", 507)
        return len(tokens)

    def release_kept(self, rid: str) -> bool:
        """Forget the kept KV of ``rid`` (its trajectory ended); whether there was one."""
        return self.kept.release(rid)

    def _request_from_blob(self, blob: dict[str, Any], on_done: DoneCallback | None) -> Request:
        """Validate an export's fields (it is untrusted input) and build the request."""
        vocab = self.model.config.vocab_size

        def ids(key: str, allow_empty: bool) -> list[int]:
            v = blob.get(key)
            if not isinstance(v, list) or not (v or allow_empty):
                raise ProtocolError(f"{key} must be a{'' if allow_empty else ' non-empty'} list of token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in v):
                raise ProtocolError(f"{key} must hold token ids in [0, {vocab})")
            return list(v)

        rid, version, lps = blob.get("rid"), blob.get("version"), blob.get("output_logprobs")
        if not isinstance(rid, str) or not rid:
            raise ProtocolError("rid must be a non-empty string")
        if isinstance(version, bool) or not isinstance(version, (str, int)):
            raise ProtocolError("version must be a string or integer")
        output_ids = ids("output_ids", allow_empty=True)
        try:
            if not isinstance(lps, list) or len(lps) != len(output_ids) or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) for x in lps
            ):
                raise TypeError
            logprobs = [float(x) for x in lps]  # TypeError for non-numbers, OverflowError for huge ints
        except (TypeError, ValueError, OverflowError):
            raise ProtocolError("output_logprobs must be a list of numbers, one per output id") from None
        migrations = blob.get("migrations")
        if isinstance(migrations, bool) or not isinstance(migrations, int) or migrations < 0:
            raise ProtocolError("migrations must be an integer >= 0")
        if not isinstance(blob.get("return_logprob"), bool):
            raise ProtocolError("return_logprob must be a boolean")
        gen = torch.Generator(device="cpu")
        try:
            gen.set_state(blob.get("rng_state"))
        except Exception as exc:  # noqa: BLE001 - TypeError, RuntimeError, ... all mean "not a state"
            raise ProtocolError(f"rng_state is not a CPU generator state: {str(exc)[:200]}") from None
        return Request(
            rid=rid,
            prompt_ids=ids("prompt_ids", allow_empty=False),
            params=SamplingParams.from_json(blob.get("params")),
            return_logprob=blob["return_logprob"],
            on_done=on_done,
            version=self.weight_version,
            required_version=str(version),
            output_ids=output_ids,
            output_logprobs=logprobs,
            generator=gen,
            migrations=migrations,
            draft_sources=self._draft_sources_of(blob.get("draft_sources")),
            spec_acceptance=self._spec_acceptance_of(blob.get("spec_acceptance")),
            keep_kv=blob.get("keep_kv") is True,
        )

    @staticmethod
    def _spec_acceptance_of(raw: Any) -> DraftAcceptance:
        """An export's ``spec_acceptance`` (absent in exports of engines without the per-request
        policy: the request starts from the prior)."""
        if raw is None:
            return DraftAcceptance()
        try:
            return DraftAcceptance.from_json(raw)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

    def _draft_sources_of(self, raw: Any) -> list[list[int]]:
        """An export's ``draft_sources`` (absent in exports of engines without speculation)."""
        if raw is None:
            return []
        vocab = self.model.config.vocab_size
        if not isinstance(raw, list) or not all(
            isinstance(src, list) and all(not isinstance(t, bool) and isinstance(t, int) and 0 <= t < vocab for t in src)
            for src in raw
        ):
            raise ProtocolError(f"draft_sources must be a list of lists of token ids in [0, {vocab})")
        return [list(src) for src in raw[-MAX_DRAFT_SOURCES:]]  # the bound submit keeps

    # ---- reporting -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting) + len(self.held),
            "max_running_requests": self.limits.max_running,
            "max_waiting_requests": self.limits.max_waiting,
            "kv_blocks_total": self.pool.total,
            "kv_blocks_used": self.pool.used,
            "kv_usage": self.pool.used / self.pool.total,
            "block_size": self.block_size,
            "max_context_length": self.max_context,
            "weight_version": self.weight_version,
            "paused": self.paused,
            "weight_update_pending": self.hold_admission,
            "steps": self.steps,
            "tokens_generated": self.tokens_generated,
            "tokens_computed": self.tokens_computed,
            **self.kept.info(),
            "speculative": self.limits.speculative,
            **self.spec.info(),
        }
