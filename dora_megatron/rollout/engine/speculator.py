"""Speculative decoding on one embedded engine instance, behind one interface (:class:`Speculator`).

WHY apart from the scheduler (:mod:`.scheduler`): batching decides which requests run and feeds
one ragged forward; speculation decides, per decoding request, which draft tokens to feed with its
last token (:mod:`.drafter`, the per-request policy of :mod:`dora_megatron.rollout.speculation`),
keeps the siblings' sampled or scored distributions the drafts are drawn from
(:mod:`.sampled_dists`, :mod:`.sibling_scores`), and counts what verification kept. The scheduler
asks it at five points: a request arrives (:meth:`Speculator.attach`), a step is planned
(:meth:`Speculator.should` and :meth:`Speculator.draft`), the logits are in
(:meth:`Speculator.step_records`, :meth:`Speculator.verify`, :meth:`Speculator.verified`), a request finishes
(:meth:`Speculator.finished`) and the weights change (:meth:`Speculator.weights_changed`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import torch

from dora_megatron.comm.protocol import ProtocolError, SamplingParams
from dora_megatron.rollout.engine.drafter import SiblingIndex, propose_draft, sample_sibling_draft, sibling_source
from dora_megatron.rollout.engine.kv_cache import BlockPool, blocks_for
from dora_megatron.rollout.engine.model import CausalLM
from dora_megatron.rollout.engine.request import Request, SchedulerLimits
from dora_megatron.rollout.engine.sampled_dists import RecordRows, SampledDists, SampledRecord, record_dists
from dora_megatron.rollout.engine.sampler import DraftLaw, verify_draft
from dora_megatron.rollout.engine.sibling_scores import score_sources, scoring_lengths, top_dists
from dora_megatron.rollout.speculation import observe_decode, observe_verify, plan_draft, should_speculate

log = logging.getLogger(__name__)

#: sibling sequences a request keeps for drafting (the newest); a group is rarely larger, and each
#: source costs a scan per verify step
MAX_DRAFT_SOURCES = 16


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


class Speculator:
    """What speculation needs of the instance: the model (scoring forwards), the KV pool (scoring
    only while it has the blocks) and the limits (``rollout.spec_*``)."""

    def __init__(self, model: CausalLM, limits: SchedulerLimits, pool: BlockPool, block_size: int,
                 max_context: int, drafter: Drafter | None = None) -> None:
        self.model = model
        self.limits = limits
        self.pool = pool
        self.block_size = block_size
        self.max_context = max_context
        self.drafter: Drafter = drafter or propose_draft
        #: finished requests' sampled distributions, for their siblings' drafts: as many rows as the pool holds tokens
        self.sampled = SampledDists(pool.total * block_size)
        self.stats = SpecStats()
        should_speculate(limits.speculative, 0, limits.spec_max_batch)  # refuses an unknown mode now

    def check_sources(self, sources: Iterable[Sequence[int]], what: str) -> None:
        """Drafts are fed to the model: an id outside the vocabulary would fail the batch."""
        vocab = self.model.config.vocab_size
        bad = [t for src in sources for t in src if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(f"{what} contain ids outside [0, {vocab}): {bad[:5]}")

    def attach(self, req: Request) -> None:
        """A request arrives: its draft sources trimmed to the newest ``MAX_DRAFT_SOURCES``, unscored."""
        req.draft_sources = [sibling_source(req.prompt_ids, src) for src in req.draft_sources[-MAX_DRAFT_SOURCES:]]
        req.draft_dists = [None] * len(req.draft_sources)
        req.draft_index = None

    def recorder(self, req: Request) -> RecordRows | None:
        """Where ``req`` records its sampling distributions for its siblings (``group`` speculation
        at a temperature above zero, ``spec_sibling_top_k`` > 0), else None."""
        lim = self.limits
        return RecordRows() if lim.speculative == "group" and lim.spec_sibling_top_k > 0 and not req.params.greedy else None

    def add_sources(self, r: Request, sources: list[list[int]]) -> None:
        """``r`` drafts from more token sequences (its group's siblings that finished later)."""
        self.check_sources(sources, "sources")
        r.draft_sources.extend(sibling_source(r.prompt_ids, src) for src in sources)
        r.draft_dists.extend([None] * len(sources))
        del r.draft_sources[:-MAX_DRAFT_SOURCES]
        del r.draft_dists[:-MAX_DRAFT_SOURCES]
        r.draft_index = None

    def should(self, batch_size: int) -> bool:
        """The policy lets a running batch of this size speculate."""
        lim = self.limits
        return should_speculate(lim.speculative, batch_size, lim.spec_max_batch)

    def step_records(self, batch: list[Request], drafts: list[list[int]], logits: torch.Tensor
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

    def draft(self, r: Request, n_running: int) -> tuple[list[int], list[DraftLaw] | None]:
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
        k = plan_draft(r.spec_acceptance, room, lim.spec_token_cost, lim.spec_probe_interval, n_running)
        if room > 0 and k == 0:
            self.stats.declined_steps += 1
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
                self.stats.recorded_sources += r.draft_dists[i] is not None
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
        self.stats.scored_tokens += computed
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

    def verify(self, r: Request, logits: torch.Tensor, draft: list[int], q: list[DraftLaw] | None
               ) -> tuple[list[int], list[float]]:
        """The tokens ``r`` yields for ``draft`` from its ``len(draft) + 1`` predicting rows of
        ``logits`` (rejection sampling against the draft's law ``q``, greedy: the longest agreeing
        prefix) and their log-probs."""
        return verify_draft(logits, draft, r.params, r.generator, q)

    def verified(self, r: Request, draft: list[int], toks: list[int], kept: int) -> None:
        """A verify step of ``r`` kept ``kept`` of the tokens ``toks`` it yielded for ``draft``:
        the request's acceptance evidence and the instance's counts."""
        accepted = next((i for i, (t, d) in enumerate(zip(toks[:kept], draft)) if t != d), min(kept, len(draft)))
        r.spec_acceptance = observe_verify(r.spec_acceptance, len(draft), accepted, rejected=accepted < min(kept, len(draft)))
        self.stats.verify_steps += 1
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_tokens += accepted
        self.stats.verify_tokens += kept

    def finished(self, r: Request, reason: dict[str, Any]) -> None:
        """``r`` leaves the instance: a completed answer's sampled distributions are kept for its siblings."""
        if r.sampled is not None and reason.get("type") in ("stop", "length") and r.sampled.n:
            ids, probs = r.sampled.rows()
            n = len(r.output_ids)
            self.sampled.keep(r.tokens, SampledRecord(len(r.prompt_ids), ids[:n], probs[:n]))
        r.sampled = None

    def weights_changed(self, reqs: Iterable[Request]) -> None:
        """New weights: what was drawn or scored with the old ones is dropped."""
        self.sampled.clear()  # drawn from the old weights: siblings of new requests would score them again
        for r in reqs:
            if r.output_ids:
                r.sampled = None  # its record would mix two sets of weights
            r.draft_dists = [None] * len(r.draft_sources)  # scored with the old weights
            r.draft_index = None

    def info(self) -> dict[str, Any]:
        return {"speculative": self.limits.speculative, **self.stats.info()}
