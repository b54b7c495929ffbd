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
by :meth:`~dora_megatron.rollout.engine.speculator.Speculator.verify`, and the KV positions of rejected
draft tokens are dropped again, so the invariant above holds after every step and the blocks a
request reserved at admission still bound its cache (a draft never reaches past the request's
remaining token budget).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from dora_megatron.comm.protocol import ProtocolError, finish_abort, finish_length, finish_stop
from dora_megatron.rollout.engine import export
from dora_megatron.rollout.engine.kept_kv import KeptKV
from dora_megatron.rollout.engine.kv_cache import BlockPool, RequestKV, blocks_for
from dora_megatron.rollout.engine.model import CausalLM
from dora_megatron.rollout.engine.request import DoneCallback, Request, SchedulerLimits, weight_version_spans
from dora_megatron.rollout.engine.routing_trace import RoutingTrace, split_step_routing
from dora_megatron.rollout.engine.sampled_dists import SampledDists
from dora_megatron.rollout.engine.sampler import DraftLaw, make_generator, sample_token
from dora_megatron.rollout.engine.speculator import Drafter, SpecStats, Speculator

__all__ = ["Request", "Scheduler", "SchedulerLimits", "weight_version_spans"]

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, model: CausalLM, limits: SchedulerLimits, weight_version: str = "0",
                 drafter: Drafter | None = None) -> None:
        self.model = model
        self.limits = limits
        self.max_context = int(limits.max_context or model.config.max_position_embeddings)
        self.block_size = int(limits.block_size)
        total = limits.kv_blocks or limits.max_running * blocks_for(self.max_context, self.block_size)
        self.pool = BlockPool(total)
        self.kept = KeptKV(self.pool, int(limits.block_size), int(total * limits.kept_kv_fraction), limits.kept_kv_s)
        self.speculator = Speculator(model, limits, self.pool, self.block_size, self.max_context, drafter)
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
        self._checksum: str | None = None

    @property
    def spec(self) -> SpecStats:
        """What speculation did on this instance (:class:`~.speculator.SpecStats`)."""
        return self.speculator.stats

    @property
    def sampled(self) -> SampledDists:
        """Finished requests' sampled distributions, kept for their siblings' drafts."""
        return self.speculator.sampled

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
        self.speculator.check_sources(req.draft_sources, "dora_draft_sources")
        self.speculator.attach(req)
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
        req.sampled = self.speculator.recorder(req)
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
        self.speculator.add_sources(r, sources)
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
        spec = self.speculator
        speculate = spec.should(len(batch))
        ids: list[int] = []
        pos: list[int] = []
        segs = []
        drafts: list[list[int]] = []
        draft_qs: list[list[DraftLaw] | None] = []
        for r in batch:
            toks = r.tokens
            start = r.kv.length
            draft, q = spec.draft(r, len(self.running)) if speculate and len(toks) - start == 1 else ([], None)
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
        recorded = spec.step_records(batch, drafts, logits)  # on the logits' device: only [rows, K] moves
        logits = logits.cpu()
        produced, row = 0, 0
        for b, (r, draft, q) in enumerate(zip(batch, drafts, draft_qs)):
            own = logits[row : row + len(draft) + 1]
            row += len(draft) + 1
            try:
                if draft:
                    toks, lps = spec.verify(r, own, draft, q)
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
            self.speculator.verified(r, draft, toks, kept)
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
        self.speculator.finished(r, reason)
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
        self.speculator.weights_changed(list(self.running) + list(self.waiting) + list(self.held))
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

    # ---- migration (the format: export.py) -------------------------------------------------
    def export_request(self, rid: str) -> bytes:
        """Remove request ``rid`` from this instance and serialise it (state, KV, RNG state).

        Its pending ``/generate`` answers with ``finish_reason.type == "abort"``,
        ``err_type == "migrated"`` and ``meta_info.dora_migrated == true``.
        """
        r = self.by_rid.get(rid)
        if r is None:
            raise ProtocolError(f"unknown rid {rid!r}", 404)
        data = export.dump_request(r, export.model_shape(self.model.config))
        self._finish(r, finish_abort("migrated to another instance", 200, "migrated"), migrated=True)
        return data

    def import_request(self, data: bytes, on_done: DoneCallback | None) -> Request:
        """Queue an exported request (first in line); it continues from its KV without re-prefill."""
        c = self.model.config
        blob = export.load_export(data, export.EXPORT_FORMAT, "request", export.model_shape(c))
        req = export.request_from_blob(blob, on_done, c.vocab_size, self.weight_version)
        req.draft_dists = [None] * len(req.draft_sources)  # scores are not exported: scored here again
        self.check_version(req.required_version)
        if req.rid in self.by_rid:
            raise ProtocolError(f"rid {req.rid!r} is already in use on this instance", 409)
        if len(req.tokens) >= self.max_context or len(req.output_ids) >= req.params.max_new_tokens:
            raise ProtocolError(f"exported request has {len(req.tokens)} tokens; nothing left to generate here")
        if self._blocks_needed(req) > self.pool.total:
            raise ProtocolError(f"request needs more KV blocks than this instance has ({self.pool.total})")
        req.kv = export.kv_of(blob, self.kv_shape, len(req.tokens))
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
        return export.dump_kept(rid, e, export.model_shape(self.model.config))

    def import_kept(self, data: bytes) -> int:
        """Keep the KV :meth:`export_kept` serialised for its trajectory's next turn here; returns
        the tokens it covers. 409 for KV of other weights than this instance holds (C1); 507 when
        the kept budget has no room for it."""
        c = self.model.config
        blob = export.load_export(data, export.KV_EXPORT_FORMAT, "KV", export.model_shape(c))
        fields = export.kept_fields(blob)
        self.check_version(fields.version)
        tokens, req_kv = export.kept_of(blob, fields, c.vocab_size, self.kv_shape, self.max_context)
        if not self.kept.keep(fields.rid, tokens, req_kv, fields.version):
            raise ProtocolError(f"no room to keep {len(tokens)} tokens of KV", 507)
        return len(tokens)

    def release_kept(self, rid: str) -> bool:
        """Forget the kept KV of ``rid`` (its trajectory ended); whether there was one."""
        return self.kept.release(rid)

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
            **self.speculator.info(),
        }
