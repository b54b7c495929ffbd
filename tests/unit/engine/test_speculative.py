"""Speculative decoding in the embedded engine: the verify rule is exact, the scheduler's KV and
block accounting survive rejections, and migration and aborts work mid-speculation.

The statistical tests use fixed seeds (deterministic) and a chi-square statistic whose p-value
is :func:`chi2_sf`; each states its power against a named alternative.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from dora_megatron.comm.protocol import GenerateRequest, ProtocolError, SamplingParams
from dora_megatron.rollout.engine.drafter import (DraftDistribution, SiblingIndex, SourceDists, propose_draft,
                                                  sample_sibling_draft, sibling_context, sibling_source)
from dora_megatron.rollout.engine.kv_cache import RequestKV
from dora_megatron.rollout.engine.sampler import (accept_or_resample, accept_or_resample_sampled, make_generator,
                                                  verify_draft)
from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
from dora_megatron.rollout.speculation import speculation_summary
from tests.helpers.stats import chi2_sf, gof_pvalue
from tests.helpers.engine_logits import full_logits


# ---- the acceptance rule as a pure function --------------------------------------------------
PROBS = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
N_DRAWS = 20_000


def _draws(rule, draft: int) -> torch.Tensor:
    g = make_generator(1234)
    counts = torch.zeros(len(PROBS))
    for _ in range(N_DRAWS):
        counts[rule(PROBS, draft, g)] += 1
    return counts


@pytest.mark.parametrize("draft", [0, 4, 5])  # the likeliest token, an unlikely one, one with no mass
def test_accept_or_resample_draws_the_target_distribution(draft):
    """Power: with 20,000 draws over 5 cells, a rule that moves 0.02 of probability between two
    tokens (noncentrality 107) is rejected at alpha = 0.001 with probability > 0.999."""
    assert gof_pvalue(_draws(accept_or_resample, draft), PROBS) > 1e-3


def test_the_goodness_of_fit_test_rejects_a_wrong_rule():
    def resample_from_p(probs, draft, g):  # the classic bug: on rejection, draw from p itself
        if float(torch.rand((), generator=g)) < float(probs[draft]):
            return draft
        return int(torch.multinomial(probs, 1, generator=g))

    assert gof_pvalue(_draws(resample_from_p, 0), PROBS) < 1e-6


def _draw_from(q: dict[int, float], g: torch.Generator) -> int:
    ids = list(q)
    return ids[int(torch.multinomial(torch.tensor([q[i] for i in ids]), 1, generator=g))]


def _sampled_draws(rule, q: dict[int, float]) -> torch.Tensor:
    """Tokens out of ``rule`` for drafts drawn from ``q``, the drafter's random numbers from the
    same generator as the rule's (as the engine does)."""
    g = make_generator(4321)
    counts = torch.zeros(len(PROBS))
    for _ in range(N_DRAWS):
        counts[rule(PROBS, _draw_from(q, g), DraftDistribution.of(q), g)] += 1
    return counts


SAMPLED_QS = {"close": {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.15, 4: 0.10}, "skewed": {4: 0.7, 0: 0.3},
              "massless": {5: 0.5, 1: 0.5}, "point": {2: 1.0}}


@pytest.mark.parametrize("q", SAMPLED_QS.values(), ids=SAMPLED_QS.keys())
def test_a_sampled_draft_is_kept_or_redrawn_to_the_target_distribution(q):
    """Drafts drawn from ``q`` (near ``p``; on an unlikely token; half on a token ``p`` gives no mass;
    a point mass). Power as above: 20,000 draws, a 0.02 shift between two tokens is rejected at
    alpha = 0.001 with probability > 0.999."""
    assert gof_pvalue(_sampled_draws(accept_or_resample_sampled, q), PROBS) > 1e-3


def test_the_goodness_of_fit_test_rejects_a_sampled_rule_with_the_point_mass_redraw():
    def wrong_redraw(probs, draft, q, g):  # kept as min(1, p/q), but redrawn from p without the draft
        if float(torch.rand((), generator=g)) * q.prob(draft) < float(probs[draft]):
            return draft
        rest = probs.clone()
        rest[draft] = 0.0
        return int(torch.multinomial(rest / rest.sum(), 1, generator=g))

    assert gof_pvalue(_sampled_draws(wrong_redraw, SAMPLED_QS["skewed"]), PROBS) < 1e-6


def test_a_sampled_draft_is_kept_more_often_when_q_follows_p():
    """Why the engine samples its sibling drafts: kept with probability sum(min(p, q)), against
    p(d) for the deterministic guess d, the likeliest token here."""
    g = make_generator(5)
    q = SAMPLED_QS["close"]
    law = DraftDistribution.of(q)
    kept_sampled = sum(accept_or_resample_sampled(PROBS, d, law, g) == d for d in (_draw_from(q, g) for _ in range(4000)))
    kept_fixed = sum(accept_or_resample(PROBS, 0, g) == 0 for _ in range(4000))
    assert kept_sampled / 4000 == pytest.approx(0.95, abs=0.02)  # sum(min(p, q))
    assert kept_fixed / 4000 == pytest.approx(0.30, abs=0.02)  # p(0)


# ---- verify_draft over a fake model: the joint law of whole continuations ---------------------
VOCAB, LENGTH = 4, 3
BIGRAM = torch.log(torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25],
                                 [0.05, 0.05, 0.1, 0.8]]))


def _exact_law() -> torch.Tensor:
    """P(x1 x2 x3 | x0 = 0) of the Markov chain: the product of its transition probabilities."""
    p = BIGRAM.exp()
    law = torch.zeros(VOCAB**LENGTH)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=LENGTH)):
        prev, prob = 0, 1.0
        for t in seq:
            prob, prev = prob * float(p[prev, t]), t
        law[i] = prob
    return law


def _speculative_sequences(n: int, drafter) -> torch.Tensor:
    """Continuations of token 0 made only by verify passes over drafts from ``drafter``."""
    params = SamplingParams(temperature=1.0)
    g = make_generator(7)
    counts = torch.zeros(VOCAB**LENGTH)
    for _ in range(n):
        seq = [0]
        while len(seq) < LENGTH + 1:
            drafted = drafter(seq, g)
            draft, q = drafted if isinstance(drafted, tuple) else (drafted, None)
            draft, q = draft[: LENGTH - len(seq)], None if q is None else q[: LENGTH - len(seq)]
            logits = BIGRAM[torch.tensor([seq[-1], *draft])]
            toks, _ = verify_draft(logits, draft, params, g, q)
            seq.extend(toks)
        idx = 0
        for t in seq[1 : LENGTH + 1]:
            idx = idx * VOCAB + t
        counts[idx] += 1
    return counts


def _sampled_markov_drafter(seq, g):
    """Drafts drawn from a distribution that depends on the context (a wrong guess of the chain)."""
    draft, qs, last = [], [], seq[-1]
    for _ in range(3):
        q = {(last + 1) % VOCAB: 0.5, (last + 2) % VOCAB: 0.3, last: 0.2}
        last = _draw_from(q, g)
        draft.append(last)
        qs.append(DraftDistribution.of(q))
    return draft, qs


#: sibling answers over the chain's tokens that match a context at lengths 1 to 4
SIBLINGS = SiblingIndex([[0, 1, 2, 3, 0, 0, 1, 1, 3, 2, 0, 2, 0, 0, 3], [1, 0, 0, 3, 3, 1, 2, 2, 0, 1, 0, 0, 1]])


def _sibling_drafter(seq, g):
    return sample_sibling_draft(seq, 3, SIBLINGS, g)


def _scored_rows(src: list[int], offset: int) -> SourceDists:
    """Distributions for a source's positions that are not the chain's: a point mass (second
    entry of zero probability) at every third position, else two tokens at 0.7 / 0.3."""
    ids = [[(t + offset) % VOCAB, (t + offset + 1) % VOCAB] for t in src]
    probs = [[1.0, 0.0] if i % 3 == 0 else [0.7, 0.3] for i in range(len(src))]
    return SourceDists(torch.tensor(ids), torch.tensor(probs))


SCORED = SiblingIndex(SIBLINGS.sources, dists=[_scored_rows(src, i + 1) for i, src in enumerate(SIBLINGS.sources)])


def _scored_drafter(seq, g):
    return sample_sibling_draft(seq, 3, SCORED, g)


@pytest.mark.parametrize("drafter", [lambda seq, g: [0, 0, 0], lambda seq, g: [3, 3],
                                     lambda seq, g: [(seq[-1] + 1) % 4] * 2, _sampled_markov_drafter,
                                     _sibling_drafter, _scored_drafter],
                         ids=["likely", "unlikely", "rotating", "sampled", "siblings", "scored siblings"])
def test_speculative_continuations_follow_the_model(drafter):
    """Power: 10,000 continuations over 64 cells; a shift of 0.02 of probability between two
    sequences of probability ~0.05 (noncentrality ~160) is rejected at alpha = 0.001 with
    probability > 0.999. The ``siblings`` arm is the engine's own drafter: it holds only if each
    draft token is drawn from the ``q`` it is verified against."""
    assert gof_pvalue(_speculative_sequences(10_000, drafter), _exact_law()) > 1e-3


def test_the_joint_law_test_rejects_a_draft_verified_against_another_q():
    """The ``siblings`` arm above can fail: the same draws verified against a ``q`` that is not the
    one they came from (uniform over its support) give continuations off the chain's law."""
    def mismatched(seq, g):
        draft, qs = _sibling_drafter(seq, g)
        supports = [set(q.support()[0].tolist()) for q in qs]
        return draft, [DraftDistribution.of({t: 1.0 / len(ts) for t in ts}) for ts in supports]

    assert gof_pvalue(_speculative_sequences(10_000, mismatched), _exact_law()) < 1e-3


def test_verify_draft_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    assert verify_draft(logits, [1, 0], greedy, make_generator(0))[0] == [1, 0, 2]  # all kept + bonus
    toks, lps = verify_draft(logits, [1, 2], greedy, make_generator(0))
    assert toks == [1, 0]  # the argmax replaces the first wrong draft token and ends the run
    assert lps == pytest.approx([float(torch.log_softmax(logits[0], -1)[1]), float(torch.log_softmax(logits[1], -1)[0])])
    hot = SamplingParams(temperature=0.5)
    toks, lps = verify_draft(logits, [1, 0], hot, make_generator(3))
    assert lps == pytest.approx([float(torch.log_softmax(logits[i] / 0.5, -1)[t]) for i, t in enumerate(toks)])
    with pytest.raises(ValueError, match="needs 3 logits rows"):
        verify_draft(logits[:2], [1, 0], greedy, make_generator(0))


def test_sibling_distribution_averages_every_matching_length():
    index = SiblingIndex([[1, 2, 3, 4, 1, 2, 5], [9, 2, 3, 7]])
    # after [.., 1, 2]: length 1 (token 2) is followed by 3, 5, 3; length 2 ([1, 2]) by 3, 5
    assert index.next_distribution([8, 1, 2]) == pytest.approx({3: (2 / 3 + 1 / 2) / 2, 5: (1 / 3 + 1 / 2) / 2})
    # after [1, 2, 3]: lengths 1 and 2 are followed by 4 and 7, length 3 only by 4
    assert index.next_distribution([1, 2, 3]) == pytest.approx({4: (0.5 + 0.5 + 1) / 3, 7: (0.5 + 0.5) / 3})
    assert index.next_distribution([5]) is None  # 5 ends its source: nothing followed it
    assert index.next_distribution([]) is None


def test_a_frequent_last_token_does_not_hide_longer_matches():
    # token 8 occurs 101 times, always after 1 but once, at the start, after 7 (followed by 9)
    index = SiblingIndex([[7, 8, 9] + [8, 1] * 100])
    assert index.next_distribution([5, 7, 8]) == pytest.approx({1: 0.5, 9: 0.5})  # lengths 1 and 2 averaged


def test_sampled_draft_ends_where_no_sibling_matches_and_keeps_each_q():
    index = SiblingIndex([[1, 2, 3, 4]])
    draft, qs = sample_sibling_draft([7, 2], 5, index, make_generator(0))
    assert draft == [3, 4] and [q.q for q in qs] == [{3: 1.0}, {4: 1.0}]  # after 4 nothing follows in the source
    assert sample_sibling_draft([8], 3, index, make_generator(0)) == ([], [])
    draws = [sample_sibling_draft([0], 1, SiblingIndex([[0, 1, 0, 2, 0, 2]]), make_generator(i))[0][0]
             for i in range(400)]
    assert draws.count(2) / 400 == pytest.approx(2 / 3, abs=0.08)  # drawn as q says, not its likeliest


def _dists(rows: list[dict[int, float]], start: int = 0) -> SourceDists:
    """SourceDists whose row i is ``rows[i]`` (two tokens each)."""
    return SourceDists(torch.tensor([list(r) for r in rows]), torch.tensor([list(r.values()) for r in rows]), start)


def test_scored_q_is_the_mean_of_each_sources_nearest_longest_match():
    a = [1, 2, 3, 9, 1, 2, 3, 9, 4]
    b = [5, 2, 3, 9, 6]
    rows_a = [{10 + i: 0.75, 40 + i: 0.25} for i in range(len(a))]  # a distinct distribution per position
    rows_b = [{20 + i: 0.5, 40 + i: 0.5} for i in range(len(b))]
    index = SiblingIndex([a, b], dists=[_dists(rows_a), _dists(rows_b)])
    # [1, 2, 3] matches a at positions 2 and 6 (length 3) and b only for length 2: b is left out;
    # of a's two occurrences the one nearest the context's own last position (6) is taken
    assert index.next_distribution([0, 0, 0, 0, 1, 2, 3]) == pytest.approx({16: 0.75, 46: 0.25})
    assert index.next_distribution([1, 2, 3]) == pytest.approx({12: 0.75, 42: 0.25})  # nearer position 2
    # [7, 3, 9]: length 2 ([3, 9]) in both sources; a's nearest to position 2 is at 3, b's at 3
    assert index.next_distribution([7, 3, 9]) == pytest.approx({13: 0.375, 43: 0.375, 23: 0.25})
    # a source's start places it: a source 4 positions into its sibling's sequence has its
    # position 2 (not 6) nearest the context's position 6
    late = SiblingIndex([a], dists=[_dists(rows_a, start=4)])
    assert late.next_distribution([0, 0, 0, 0, 1, 2, 3]) == pytest.approx({12: 0.75, 42: 0.25})
    assert index.next_distribution([8, 8]) is None and index.next_distribution([6]) is None  # 6 ends b
    # both sources match [1, 2, 3] over 3 tokens: both rows count, whichever source comes first
    c = [1, 2, 3, 8, 5]
    rows_c = [{30 + i: 1.0, 41: 0.0} for i in range(len(c))]
    for order in ([a, c], [c, a]):
        dists = [_dists(rows_a if src is a else rows_c) for src in order]
        both = SiblingIndex(order, dists=dists)
        assert both.next_distribution([1, 2, 3]) == pytest.approx({12: 0.375, 42: 0.125, 32: 0.5})
    with pytest.raises(ValueError, match="one SourceDists row per source token"):
        SiblingIndex([a, b], dists=[_dists(rows_a), _dists(rows_b[:-1])])


def test_scored_drafts_are_drawn_from_the_mean_the_verify_rule_is_handed():
    """A scored index's draft law (a row per source, drawn as a mixture) is the mean of the rows:
    its draws follow ``next_distribution``, its ``prob`` and ``support`` give that mean, and a
    token of probability zero in a row (top-k cut) is never drawn. Power: 20,000 draws over 4
    cells; moving 0.02 of probability between two tokens is rejected at alpha 0.001 with
    probability > 0.999."""
    a, b = [1, 2, 3, 9], [4, 2, 3, 8]
    rows_a = [{10: 0.6, 11: 0.4, 12: 0.0}] * len(a)
    rows_b = [{11: 0.7, 13: 0.3, 12: 0.0}] * len(b)
    index = SiblingIndex([a, b], dists=[_dists(rows_a), _dists(rows_b)])
    law = index.draft_distribution([7, 2, 3])  # [2, 3] in both sources: both rows count
    mean = index.next_distribution([7, 2, 3])
    assert mean == pytest.approx({10: 0.3, 11: 0.55, 13: 0.15})
    assert {t: law.prob(t) for t in (10, 11, 12, 13, 14)} == pytest.approx({**mean, 12: 0.0, 14: 0.0})
    ids, weights = law.support()
    summed: dict[int, float] = {}
    for t, w in zip(ids.tolist(), weights.tolist()):
        summed[t] = summed.get(t, 0.0) + w
    assert summed == pytest.approx({**mean, 12: 0.0})
    g = make_generator(17)
    counts = torch.zeros(14)
    for _ in range(20_000):
        counts[law.draw(g)] += 1
    probs = torch.zeros(14)
    for t, w in mean.items():
        probs[t] = w
    assert gof_pvalue(counts, probs) > 1e-3  # also asserts token 12 (probability zero) never came
    shifted = probs.clone()
    shifted[10] += 0.02
    shifted[11] -= 0.02
    assert gof_pvalue(counts, shifted) < 1e-3
    # sources scored at different widths: the redraw's support still holds the mean
    narrow = SiblingIndex([a, b], dists=[_dists(rows_a), _dists([{11: 0.7, 13: 0.3}] * len(b))])
    ids, weights = narrow.draft_distribution([7, 2, 3]).support()
    assert len(ids) == 5 and float(weights.sum()) == pytest.approx(1.0)
    assert torch.zeros(14, dtype=torch.float64).index_put_((ids,), weights, accumulate=True)[[10, 11, 13]].tolist() \
        == pytest.approx([0.3, 0.55, 0.15])


def test_sibling_context_restores_the_shared_prompt():
    prompt = [5, 6, 7, 8, 9]
    src = sibling_source(prompt, prompt + [1, 2])
    assert sibling_context(prompt, src) == (prompt + [1, 2], 2)
    assert sibling_context(prompt, [4, 4, 1]) == ([4, 4, 1], 0)  # another prompt's sibling: kept whole


def test_propose_draft_prefers_long_matches_and_siblings():
    assert propose_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose_draft([7, 1, 2, 9, 5, 1, 2], 2) == [9, 5]  # the most recent occurrence with a continuation
    assert propose_draft([1, 2, 3, 4, 1, 2], 3, sources=[[8, 1, 2, 6, 6]]) == [6, 6]
    assert propose_draft([4, 1, 2, 9, 1, 2], 2) == [9, 1]  # a 2-gram match beats a 1-gram one
    assert propose_draft([4, 1, 2, 9, 1, 2], 2, sources=[[2, 7, 7]]) == [7, 7]  # any sibling match beats both
    assert sibling_source([5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 1, 2]) == [7, 8, 9, 1, 2]  # the answer + 3 prompt tokens
    assert sibling_source([5, 6], [4, 4, 1]) == [4, 4, 1]  # another prompt: kept whole
    assert propose_draft([5, 6], 3) == []
    assert propose_draft([5, 5], 0) == []


# ---- the scheduler -----------------------------------------------------------------------------
PROMPTS = [[5 + i, 20 + 2 * i, 30] * (3 + i) for i in range(3)]


class Collector(dict):
    def __call__(self, resp: dict) -> None:
        self[resp["meta_info"]["id"]] = resp


def _req(rid, prompt, sink, n=40, sources=(), **sp):
    sp.setdefault("ignore_eos", True)
    return Request(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=n, **sp),
                   return_logprob=True, on_done=sink, draft_sources=[list(s) for s in sources])


def _sched(model, mode="off", **kw) -> Scheduler:
    # a draft token costs nothing by default here: every request then drafts at every step (the
    # estimate never reaches 0), which the tests of the mechanism below need
    kw.setdefault("spec_token_cost", 0.0)
    return Scheduler(model, SchedulerLimits(max_running=4, speculative=mode, spec_tokens=4, **kw))


def _check_kv(s: Scheduler) -> None:
    """The invariant after every step: KV holds all tokens but the last; blocks add up."""
    for r in s.running:
        assert r.kv.length == len(r.tokens) - 1 or r.kv.length == 0
    assert s.pool.used == sum(r.reserved_blocks for r in s.running)


def _run(s: Scheduler, reqs, limit=1000) -> Collector:
    sink = Collector()
    for r in reqs:
        r.on_done = sink
        s.submit(r)
    for _ in range(limit):
        if not s.can_step():
            break
        s.step()
        _check_kv(s)
    assert s.pool.used == 0 and not s.by_rid
    return sink


def _lps(resp):
    return [x[0] for x in resp["meta_info"]["output_token_logprobs"]]


def test_greedy_outputs_and_logprobs_identical_with_speculation(moe_model):
    plain = _run(_sched(moe_model), [_req(f"r{i}", p, None, temperature=0.0) for i, p in enumerate(PROMPTS)])
    sibling = plain["r0"]["output_ids"]
    for mode in ("ngram", "group"):
        s = _sched(moe_model, mode)
        spec = _run(s, [_req(f"r{i}", p, None, temperature=0.0, sources=[PROMPTS[0] + sibling])
                        for i, p in enumerate(PROMPTS)])
        assert s.spec.verify_steps > 0 and s.spec.accepted_tokens > 0
        assert s.spec.accepted_tokens < s.spec.draft_tokens  # some drafts were rejected
        for rid, resp in plain.items():
            assert spec[rid]["output_ids"] == resp["output_ids"]
            assert _lps(spec[rid]) == pytest.approx(_lps(resp), abs=1e-4)
        assert s.steps < 40  # fewer forward passes than tokens


def test_group_drafts_come_from_the_siblings(moe_model):
    ref = _run(_sched(moe_model), [_req("a", PROMPTS[1], None, temperature=0.0)])["a"]["output_ids"]
    accepted = {}
    for mode in ("ngram", "group"):
        s = _sched(moe_model, mode)
        _run(s, [_req("a", PROMPTS[1], None, temperature=0.0, sources=[PROMPTS[1] + ref])])
        accepted[mode] = s.spec.accepted_tokens
    assert accepted["group"] > accepted["ngram"]
    assert accepted["group"] >= 30  # a sibling that answered the same: nearly every draft is kept


def _two_sample_pvalue(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that ``a`` and ``b`` are drawn from one distribution (rare cells merged)."""
    cells, rest = [], [0, 0]
    for t in set(a) | set(b):
        x, y = a.count(t), b.count(t)
        if x + y >= min_count:
            cells.append((x, y))
        else:
            rest = [rest[0] + x, rest[1] + y]
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        for obs, n in ((x, len(a)), (y, len(b))):
            exp = (x + y) * n / (len(a) + len(b))
            stat += (obs - exp) ** 2 / exp
    return chi2_sf(stat, len(cells) - 1)


def test_group_at_temperature_one_samples_its_drafts_from_the_siblings_exactly(moe_model):
    """The engine end to end at temperature 1: group drafts drawn from four siblings are kept more
    often per verify step than the deterministic drafter's, and the second and third tokens of
    600 requests agree with 600 decoded without speculation (chi-square, Bonferroni over the two
    positions). That comparison only catches gross faults (a lost or misplaced token): its power
    against a subtly wrong rule is low (a wrong redraw gave p = 0.01-0.03 at 3,000 samples on a
    peakier model), so the exactness rests on the rule and joint-law tests above."""
    prompt, n = PROMPTS[2], 600
    sibs = _run(_sched(moe_model), [_req(f"s{i}", prompt, None, n=8, temperature=1.0, sampling_seed=100 + i)
                                    for i in range(4)])
    sources = [prompt + r["output_ids"] for r in sibs.values()]
    outs, kept = {}, {}
    for mode in ("off", "ngram", "group"):
        s = Scheduler(moe_model, SchedulerLimits(max_running=64, speculative=mode, spec_tokens=4, spec_token_cost=0.0,
                                                 spec_max_batch=64))
        reqs = [_req(f"d{i}", prompt, None, n=3, temperature=1.0, sampling_seed=(1 << 20) * len(outs) + i,
                     sources=sources) for i in range(n)]
        got = _run(s, reqs)
        outs[mode] = [r["output_ids"] for r in got.values()]
        kept[mode] = s.spec.accepted_tokens / max(s.spec.verify_steps, 1)
        sampled = sum(r.draft_index is not None for r in reqs)
        assert sampled == (n if mode == "group" else 0)  # group drew its drafts from the siblings' q
    assert kept["group"] > kept["ngram"]
    for pos in (1, 2):
        p = _two_sample_pvalue([o[pos] for o in outs["off"]], [o[pos] for o in outs["group"]])
        assert 2 * p > 1e-3


def test_stop_token_inside_an_accepted_run_ends_the_request_there(moe_model):
    full = _run(_sched(moe_model), [_req("a", PROMPTS[0], None, temperature=0.0)])["a"]["output_ids"]
    cut = next(j for j in range(8, len(full)) if full[j] not in full[:j])  # a token's first appearance
    stop = full[cut]
    s = _sched(moe_model, "group")
    sources = [PROMPTS[0] + full]
    sink = Collector()
    s.submit(_req("a", PROMPTS[0], sink, temperature=0.0, sources=sources, stop_token_ids=[stop]))
    while s.can_step():
        before = list(s.by_rid["a"].tokens)
        s.step()
    draft = propose_draft(before, 4, [sibling_source(PROMPTS[0], x) for x in sources])  # the last step's draft
    made = len(before) - len(PROMPTS[0])
    assert draft[cut - made] == stop and len(draft) > cut - made + 1
    assert sink["a"]["output_ids"] == full[: cut + 1]
    assert sink["a"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert s.pool.used == 0


def test_max_new_tokens_is_exact_under_speculation(moe_model):
    s = _sched(moe_model, "ngram")
    out = _run(s, [_req(f"r{i}", p, None, n=21 + i, temperature=0.0) for i, p in enumerate(PROMPTS)])
    assert [len(out[f"r{i}"]["output_ids"]) for i in range(3)] == [21, 22, 23]
    assert s.spec.verify_steps > 0


def test_kv_after_rejections_equals_a_fresh_prefill(moe_model):
    for seed in range(3, 43):  # the first seed whose decode keeps part of its drafts and rejects part
        s = _sched(moe_model, "ngram")
        s.submit(_req("a", PROMPTS[2], Collector(), n=60, temperature=1.0, sampling_seed=seed))
        while "a" in s.by_rid and (s.spec.accepted_tokens == s.spec.draft_tokens or s.spec.accepted_tokens == 0):
            s.step()
            _check_kv(s)
        if "a" in s.by_rid:
            break
    else:
        pytest.fail("no decode kept part of its drafts and rejected part")
    r = s.by_rid["a"]
    fresh = RequestKV(s.kv_shape)
    kept = r.tokens[:-1]
    fresh.ensure_capacity(len(kept))
    moe_model.forward_segments(torch.tensor(kept), torch.arange(len(kept)), [(fresh, len(kept))])
    assert r.kv.length == fresh.length
    torch.testing.assert_close(r.kv.export_tensor(), fresh.export_tensor(), atol=1e-5, rtol=1e-4)


def test_policy_speculates_only_up_to_spec_max_batch(moe_model):
    verify_steps = {}
    for cap in (2, 3):  # three requests that run together from the first step to the last
        s = _sched(moe_model, "ngram", spec_max_batch=cap)
        _run(s, [_req(f"r{i}", p, None, n=10, temperature=0.0) for i, p in enumerate(PROMPTS)])
        verify_steps[cap] = s.spec.verify_steps
    assert verify_steps[2] == 0 and verify_steps[3] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_migration_mid_speculation_continues_exactly(moe_model, temperature):
    # the per-request policy on (a draft token costs a fifth of a step): the draft lengths, hence the
    # random numbers drawn, follow the request's acceptance estimate, which must travel with it
    sibling = _run(_sched(moe_model), [_req("s", PROMPTS[0], None, temperature=temperature, sampling_seed=6)])["s"]
    sources = [PROMPTS[0] + sibling["output_ids"]]  # a sibling: at temperature 1 group drafts only from siblings
    ref = _run(_sched(moe_model, "group", spec_token_cost=0.2),
               [_req("a", PROMPTS[0], None, temperature=temperature, sampling_seed=5, sources=sources)])["a"]
    src = _sched(moe_model, "group", spec_token_cost=0.2)
    sink = Collector()
    src.submit(_req("a", PROMPTS[0], sink, temperature=temperature, sampling_seed=5, sources=sources))
    while "a" in src.by_rid and (src.spec.verify_steps < 1 or len(src.by_rid["a"].output_ids) < 12):
        src.step()  # on to mid-request, after drafting
    assert "a" in src.by_rid and src.spec.verify_steps >= 1
    acceptance = src.by_rid["a"].spec_acceptance
    blob = src.export_request("a")
    assert src.pool.used == 0 and sink["a"]["meta_info"]["dora_migrated"]
    dst = _sched(moe_model, "group", spec_token_cost=0.2)
    moved = Collector()
    req = dst.import_request(blob, moved)
    assert req.draft_sources == [sibling_source(PROMPTS[0], s) for s in sources]
    assert req.spec_acceptance == acceptance and acceptance.trials > 0
    while dst.can_step():
        dst.step()
        _check_kv(dst)
    assert moved["a"]["output_ids"] == ref["output_ids"]
    assert _lps(moved["a"]) == pytest.approx(_lps(ref), abs=1e-4)
    assert dst.pool.used == 0


def test_abort_mid_speculation_frees_exactly_its_blocks(moe_model):
    ref = _run(_sched(moe_model), [_req("b", PROMPTS[1], None, temperature=0.0)])["b"]["output_ids"]
    s = _sched(moe_model, "ngram")
    sink = Collector()
    s.submit(_req("a", PROMPTS[0], sink, temperature=0.0))
    s.submit(_req("b", PROMPTS[1], sink, temperature=0.0))
    while s.spec.verify_steps < 4:
        s.step()
    partial = list(s.by_rid["a"].output_ids)
    assert s.abort("a") == 1
    assert sink["a"]["output_ids"] == partial and sink["a"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert s.pool.used == s.by_rid["b"].reserved_blocks
    while s.can_step():
        s.step()
        _check_kv(s)
    assert sink["b"]["output_ids"] == ref and s.pool.used == 0


@pytest.mark.parametrize("field, value, message", [
    ("draft_sources", [[1, 10**9]], r"^draft_sources\[0\]\[1\] must be a token id < \d+, got 1000000000$"),
    ("draft_sources", [[1], [2, 2.5]], r"^draft_sources\[1\]\[1\] must be an integer, got 2\.5$"),
    ("draft_sources", [[1, True]], r"^draft_sources\[0\]\[1\] must be an integer, got True$"),
    ("prompt_ids", [1, -3], r"^prompt_ids\[1\] must be >= 0, got -3$"),
    ("version", {"v": 1}, r"^version must be a string or an integer, got \{'v': 1\}$"),
    ("migrations", True, r"^migrations must be an integer, got True$"),
])
def test_bad_fields_in_an_import_are_refused(moe_model, field, value, message):
    src = _sched(moe_model, "group")
    src.submit(_req("a", PROMPTS[0], Collector(), sources=[[1, 2]]))
    src.step()
    blob = torch.load(io.BytesIO(src.export_request("a")), weights_only=True)
    blob[field] = value
    buf = io.BytesIO()
    torch.save(blob, buf)
    with pytest.raises(ProtocolError, match=message) as e:
        _sched(moe_model, "group").import_request(buf.getvalue(), None)
    assert e.value.status == 400


def test_unknown_mode_is_refused_at_construction(moe_model):
    with pytest.raises(ValueError, match="rollout.speculative must be one of"):
        _sched(moe_model, "medusa")


def test_generate_request_carries_draft_sources():
    g = GenerateRequest.from_json({"input_ids": [1, 2], "dora_draft_sources": [[1, 2, 3], [1, 2]]})
    assert g.dora_draft_sources == [[1, 2, 3], [1, 2]]
    assert GenerateRequest.from_json(g.to_json()).dora_draft_sources == g.dora_draft_sources
    assert "dora_draft_sources" not in GenerateRequest([1]).to_json()
    with pytest.raises(ProtocolError, match=r"dora_draft_sources\[1\]"):
        GenerateRequest.from_json({"input_ids": [1], "dora_draft_sources": [[1], ["x"]]})


def test_speculation_summary_sums_instances():
    out = speculation_summary([{"spec_verify_steps": 4, "spec_draft_tokens": 16, "spec_accepted_tokens": 6,
                                "spec_verify_tokens": 10, "spec_scored_tokens": 90},
                               {"spec_verify_steps": 0, "spec_scored_tokens": 30, "spec_recorded_sources": 2}])
    assert out["spec_verify_steps"] == 4 and out["accepted_tokens_per_step"] == 1.5
    assert (out["spec_scored_tokens"], out["spec_recorded_sources"]) == (120, 2)
    assert out["tokens_per_verify_step"] == 2.5
    assert speculation_summary([])["tokens_per_verify_step"] == 0.0


def test_job_keys_reach_dora_serve():
    import argparse
    from pathlib import Path

    from dora_megatron.cli import serve
    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.plan import local_plan

    root = Path(__file__).resolve().parents[3]
    keys = ["rollout.speculative=group", "rollout.spec_tokens=6", "rollout.spec_max_batch=3",
            "rollout.spec_sibling_top_k=7"]
    cfg = load_config(root / "configs" / "cpu_tiny.yaml", keys)
    argv = list(next(p.argv for p in local_plan(cfg, "/m", "/r") if p.role == "engine"))
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(["0" if a == "<free-port>" else a for a in argv[argv.index("serve") + 1 :]])
    assert (args.speculative, args.spec_tokens, args.spec_max_batch, args.spec_sibling_top_k) == ("group", 6, 3, 7)
    with pytest.raises(ConfigError, match="rollout.speculative"):
        load_config(root / "configs" / "cpu_tiny.yaml", ["rollout.engine=vllm", "rollout.speculative=ngram"])


def test_sources_pushed_to_a_running_request_are_drafted_from(moe_model):
    ref = _run(_sched(moe_model), [_req("a", PROMPTS[1], None, temperature=0.0)])["a"]["output_ids"]
    s = _sched(moe_model, "group")
    sink = Collector()
    s.submit(_req("a", PROMPTS[1], sink, temperature=0.0))
    for _ in range(3):
        s.step()
    before = s.spec.accepted_tokens
    assert not s.add_draft_sources("nobody", [[1, 2]])
    with pytest.raises(ProtocolError, match="outside"):
        s.add_draft_sources("a", [[1, 10**6]])
    assert s.add_draft_sources("a", [PROMPTS[1] + ref])
    while s.can_step():
        s.step()
    assert sink["a"]["output_ids"] == ref
    assert s.spec.accepted_tokens - before >= 25  # nearly every later token came from the pushed sibling


def test_group_speculation_on_a_users_own_bf16_model(own_model):
    """The user's own model directory (a Qwen3-MoE saved by transformers in bf16, its vocabulary
    padded past its byte-level BPE tokenizer's) and a prompt its own chat template makes from the
    Parquet file's first row: siblings decoded on an instance are recorded and drafted from there,
    another instance scores them, drafts are kept on both, and every returned logprob is the
    model's own for that token (a full forward over prompt + answer at the request's temperature)."""
    import pyarrow.parquet as pq

    from dora_megatron.data.codec import load_codec
    from dora_megatron.rollout.engine.model import load_model

    prompt = load_codec(own_model.model_dir).encode_prompt(pq.read_table(own_model.data).column("prompt")[0].as_py())
    model = load_model(str(own_model.model_dir), dtype=torch.bfloat16)  # ``dora serve --dtype bfloat16``
    assert model.config.vocab_size > len(own_model.tokenizer())
    n, temp = 24, 0.2  # an untrained model: siblings agree often enough to draft from only when cool
    here = _sched(model, "group")
    sibs = _run(here, [_req(f"s{j}", prompt, None, n=n, temperature=temp, sampling_seed=j) for j in range(3)])
    sources = [prompt + sibs[f"s{j}"]["output_ids"] for j in range(3)]
    elsewhere = _sched(model, "group")
    tails = {}
    for name, s in (("here", here), ("elsewhere", elsewhere)):
        tails[name] = _run(s, [_req("t", prompt, None, n=n, sources=sources, temperature=temp,
                                    sampling_seed=99)])["t"]
        assert s.spec.accepted_tokens > 0, name
    assert here.spec.recorded_sources == 3 and here.spec.scored_tokens == 0
    assert elsewhere.spec.recorded_sources == 0 and elsewhere.spec.scored_tokens > 0
    for name, resp in tails.items():
        out = resp["output_ids"]
        kv = RequestKV(model.kv_shape(16))
        kv.ensure_capacity(len(prompt) + len(out))
        ids = torch.tensor(prompt + out)
        with torch.inference_mode():
            logits = model.logits(model.forward_segments(ids, torch.arange(len(ids)), [(kv, len(ids))])).float()
        want = torch.log_softmax(logits[len(prompt) - 1 : -1] / temp, -1)[torch.arange(len(out)), torch.tensor(out)]
        # bf16: a verify step and one full forward round differently (measured up to 0.035 here);
        # a wrong row or the draft's own probability would be off by far more at this temperature
        assert _lps(resp) == pytest.approx(want.tolist(), abs=0.1), name


def test_sources_pushed_to_a_running_request_reach_its_sampled_drafts(moe_model):
    s = _sched(moe_model, "group", spec_sibling_top_k=0)  # the counts' q: exact to check by hand
    first, later = PROMPTS[0] + [7, 8, 9], PROMPTS[0] + [11, 12, 13]
    req = _req("a", PROMPTS[0], Collector(), temperature=1.0, sources=[first])
    s.submit(req)
    for _ in range(3):
        s.step()
    assert req.draft_index is not None and req.draft_index.next_distribution([12]) is None
    assert s.add_draft_sources("a", [later])
    s.step()
    assert req.draft_index.next_distribution([12]) == {13: 1.0}  # drafted from a fresh index


def test_pushed_sources_are_scored_once_each(moe_model):
    """A running request scores a pushed sibling and keeps the scores of the ones it had: the
    scoring forward computes only the new sibling's tokens (the shared prompt comes from the
    request's own KV)."""
    s = _sched(moe_model, "group")
    first, later = PROMPTS[0] + [7, 8, 9, 10], PROMPTS[0] + [11, 12, 13]
    req = _req("a", PROMPTS[0], Collector(), temperature=1.0, sources=[first])
    s.submit(req)
    for _ in range(3):
        s.step()
    kept = req.draft_dists[0]
    assert kept is not None and req.draft_index.dists == [kept]
    assert s.spec.scored_tokens == len(first) - len(PROMPTS[0]) + 3  # its answer and 3 prompt tokens (sibling_source)
    assert s.add_draft_sources("a", [later])
    s.step()
    assert req.draft_dists[0] is kept and req.draft_dists[1] is not None
    assert s.spec.scored_tokens == len(first) + len(later) - 2 * len(PROMPTS[0]) + 6


def test_scored_sibling_distributions_are_the_models_own(moe_model):
    """score_sources gives, after each token of a sibling, the distribution the sampler draws from
    there (temperature, top-k), computed on the sibling's whole sequence: a forward from scratch
    over it agrees."""
    from dora_megatron.rollout.engine.sampler import truncate_probs
    from dora_megatron.rollout.engine.sibling_scores import score_sources

    prompt = PROMPTS[1]
    sibs = _run(_sched(moe_model), [_req(f"s{i}", prompt, None, n=12, temperature=1.0, sampling_seed=i) for i in range(2)])
    seqs = [prompt + r["output_ids"] for r in sibs.values()]
    sources = [sibling_source(prompt, q) for q in seqs] + [[3, 4, 5, 6]]  # and one of another prompt
    kv = RequestKV(moe_model.kv_shape(16))
    kv.ensure_capacity(len(prompt))
    moe_model.forward_segments(torch.tensor(prompt), torch.arange(len(prompt)), [(kv, len(prompt))])
    kv.truncate(len(prompt) - 1)  # a kept turn's KV may end before the prompt's last token
    for params in (SamplingParams(temperature=0.7, top_k=6), SamplingParams(temperature=1.3, top_p=0.5)):
        dists, computed = score_sources(moe_model, kv, prompt, sources, params, top_k=4)
        chunked, _ = score_sources(moe_model, kv, prompt, sources, params, top_k=4, chunk_tokens=7)
        assert computed == sum(len(src) for src in sources)
        for (seq, start), d, c in zip([sibling_context(prompt, src) for src in sources], dists, chunked):
            full = full_logits(moe_model, seq)[start:]  # row j: after seq[start + j]
            assert d.ids.shape == (len(seq) - start, 4) and d.start == start
            assert torch.equal(c.ids, d.ids) and torch.allclose(c.probs, d.probs, atol=1e-5)
            for row, ids, probs in zip(full, d.ids, d.probs):
                p = truncate_probs(torch.softmax(row.float() / params.temperature, -1), params.top_k, params.top_p)
                top = p.topk(4)
                assert {t for t, w in zip(ids.tolist(), probs.tolist()) if w > 0} == \
                    {t for t, w in zip(top.indices.tolist(), top.values.tolist()) if w > 0}
                assert probs.tolist() == pytest.approx((top.values / top.values.sum()).tolist(), abs=1e-4)
    assert kv.length == len(prompt) - 1  # the request's own KV is copied from, never written


def test_scoring_waits_for_free_kv_blocks(moe_model):
    """Without the blocks for the scoring forward the request draws from the counts (nothing
    computed) and still drafts and finishes."""
    prompt = PROMPTS[0]
    sibling = _run(_sched(moe_model), [_req("s", prompt, None, n=40, temperature=1.0, sampling_seed=4)])["s"]
    sources = [prompt + sibling["output_ids"]]
    outs = {}
    for blocks in (None, 5):  # 5 blocks: the request's own 4 fit, its sibling's scoring (4 more) does not
        s = _sched(moe_model, "group", kv_blocks=blocks)
        req = _req("a", prompt, None, n=40, temperature=1.0, sampling_seed=9, sources=sources)
        outs[blocks] = _run(s, [req])["a"]["output_ids"]
        assert (req.draft_index.dists is None) == (blocks == 5)
        assert (s.spec.scored_tokens == 0) == (blocks == 5)
        assert s.spec.verify_steps > 0 and len(outs[blocks]) == 40


def _dense(d: SourceDists, vocab: int) -> torch.Tensor:
    return torch.zeros((d.ids.shape[0], vocab)).scatter_add_(1, d.ids, d.probs.float())


def test_siblings_sampled_on_the_instance_are_not_scored_again(moe_model):
    """An instance with group speculation keeps the distributions it drew a finished request's
    tokens from; a request whose siblings ran there drafts from those without a scoring forward,
    and they are the distributions scoring would compute."""
    from dora_megatron.rollout.engine.sibling_scores import score_sources

    prompt, vocab = PROMPTS[1], moe_model.config.vocab_size
    s = _sched(moe_model, "group")
    sibs = _run(s, [_req(f"s{i}", prompt, None, n=12, temperature=0.8, sampling_seed=i) for i in range(3)])
    assert len(s.sampled) == 3 and s.spec.scored_tokens == 0
    sources = [prompt + sibs[f"s{i}"]["output_ids"] for i in range(3)]
    tail = _req("t", prompt, None, n=12, temperature=0.8, sampling_seed=7, sources=sources)
    _run(s, [tail])
    assert s.spec.scored_tokens == 0 and s.spec.recorded_sources == 3 and s.spec.verify_steps > 0
    kv = RequestKV(moe_model.kv_shape(16))
    kv.ensure_capacity(len(prompt))
    moe_model.forward_segments(torch.tensor(prompt), torch.arange(len(prompt)), [(kv, len(prompt))])
    scored, _ = score_sources(moe_model, kv, prompt, tail.draft_sources, SamplingParams(temperature=0.8), 32)
    for kept, fresh in zip(tail.draft_dists, scored):
        # the output positions (after the last prompt token up to the last but one output token)
        rows = slice(2, len(fresh.ids) - 1)
        assert torch.allclose(_dense(kept, vocab)[rows], _dense(fresh, vocab)[rows], atol=1e-4)
    other = _sched(moe_model, "group")  # siblings from another instance: scored there, once
    t = _req("t", prompt, None, n=12, temperature=0.8, sampling_seed=7, sources=sources)
    _run(other, [t])
    scored = other.spec.scored_tokens
    assert scored > 0 and other.spec.recorded_sources == 0
    u = _req("u", prompt, None, n=12, temperature=0.8, sampling_seed=8, sources=sources)
    _run(other, [u])
    assert other.spec.scored_tokens == scored and other.spec.recorded_sources == 3  # kept for the group
    for mine, theirs, here in zip(t.draft_dists, u.draft_dists, tail.draft_dists):
        # the same rows, whether scored or taken from a record, and as this instance recorded them
        assert torch.equal(mine.ids, theirs.ids) and torch.equal(mine.probs, theirs.probs)
        assert torch.allclose(_dense(mine, vocab), _dense(here, vocab), atol=1e-4)


def test_a_retracted_request_keeps_recording_its_tokens(moe_model):
    """A request retracted mid-decode (pause 'retract': its KV dropped, prefilled again) keeps one
    row per output token, each the distribution its token was drawn from."""
    prompt = PROMPTS[2]
    s = _sched(moe_model, "group")
    req = _req("a", prompt, None, n=14, temperature=1.0, sampling_seed=2)
    s.submit(req)
    for _ in range(5):
        s.step()
    s.pause("retract")
    s.resume()
    while s.can_step():
        s.step()
    seq = prompt + req.output_ids
    kept = s.sampled.source_dists(prompt, sibling_source(prompt, seq))
    full = torch.softmax(full_logits(moe_model, seq)[len(prompt) - 1 : -1].float(), -1)
    rows = _dense(kept, moe_model.config.vocab_size)[2:-1]  # after the last prompt token .. the last but one
    assert rows.shape[0] == 14
    top = full.topk(32, dim=-1)
    assert torch.allclose(rows.gather(1, top.indices), top.values / top.values.sum(-1, keepdim=True), atol=1e-4)


def test_each_recording_request_of_a_batch_gets_its_own_rows(moe_model):
    """Rows are computed for the recording requests only: a greedy request (which records
    nothing) ahead of two sampled ones in every step, one of them drafting (several rows a step),
    at two temperatures; each record is its own request's sampling distributions."""
    sib = _run(_sched(moe_model), [_req("s", PROMPTS[0], None, n=14, temperature=0.8, sampling_seed=4)])["s"]
    for seed in range(5, 45):  # the first seed whose drafting request keeps a draft token (several rows a step)
        s = _sched(moe_model, "group")
        greedy = _req("g", PROMPTS[1], None, n=14, temperature=0.0)
        drafting = _req("a", PROMPTS[0], None, n=14, temperature=0.8, sampling_seed=seed,
                        sources=[PROMPTS[0] + sib["output_ids"]])
        plain = _req("b", PROMPTS[2], None, n=14, temperature=1.0, sampling_seed=6)
        _run(s, [greedy, drafting, plain])
        if s.spec.accepted_tokens > 0:
            break
    else:
        pytest.fail("no drafting request kept a draft token")
    assert greedy.sampled is None and s.spec.verify_steps > 0
    for req, temp in ((drafting, 0.8), (plain, 1.0)):
        seq = req.prompt_ids + req.output_ids
        kept = s.sampled.source_dists(req.prompt_ids, sibling_source(req.prompt_ids, seq))
        full = torch.softmax(full_logits(moe_model, seq)[len(req.prompt_ids) - 1 : -1].float() / temp, -1)
        rows = _dense(kept, moe_model.config.vocab_size)[2:-1]
        assert rows.shape[0] == 14
        top = full.topk(32, dim=-1)
        assert torch.allclose(rows.gather(1, top.indices), top.values / top.values.sum(-1, keepdim=True), atol=1e-4)


def test_a_failed_scoring_leaves_the_counts_and_the_batch_runs(moe_model, monkeypatch):
    from dora_megatron.rollout.engine import speculator as sched_module

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(sched_module, "score_sources", out_of_memory)
    prompt = PROMPTS[0]
    sibling = _run(_sched(moe_model), [_req("s", prompt, None, n=30, temperature=1.0, sampling_seed=4)])["s"]
    s = _sched(moe_model, "group")
    req = _req("a", prompt, None, n=30, temperature=1.0, sampling_seed=9, sources=[prompt + sibling["output_ids"]])
    other = _req("b", PROMPTS[1], None, n=30, temperature=1.0, sampling_seed=3)
    got = _run(s, [req, other])
    assert len(got["a"]["output_ids"]) == len(got["b"]["output_ids"]) == 30
    assert req.draft_index.dists is None and s.spec.verify_steps > 0 and s.spec.scored_tokens == 0


def test_record_rows_merge_blocks_and_keep_every_row():
    from dora_megatron.rollout.engine.sampled_dists import RecordRows

    rec = RecordRows()
    step = torch.arange(6).view(3, 2)
    for i in range(150):
        rec.append(step[i % 3 : i % 3 + 1] + 10 * i, step[i % 3 : i % 3 + 1].float())
    ids, probs = rec.rows()
    assert rec.n == 150 and len(rec.blocks) == 2 and len(rec.pending) == 22
    assert ids[:, 0].tolist() == [2 * (i % 3) + 10 * i for i in range(150)] and probs.shape == (150, 2)


def test_sampled_records_are_forgotten_at_a_weight_load(moe_model):
    prompt = PROMPTS[0]
    s = _sched(moe_model, "group")
    sibs = _run(s, [_req("s", prompt, None, n=10, temperature=1.0, sampling_seed=3)])
    running = _req("r", prompt, None, n=10, temperature=1.0, sampling_seed=4)
    s.submit(running)
    s.step()
    assert len(s.sampled) == 1 and running.sampled.n == 1
    waiting = _req("w", prompt, None, n=10, temperature=1.0, sampling_seed=6, sources=[prompt + sibs["s"]["output_ids"]])
    s.submit(waiting)
    waiting.draft_dists[0] = running.sampled  # stands for scores made with the old weights
    s.load_weights({"model.norm.weight": moe_model.model.norm.weight.detach().clone()}, "1", require_all=False)
    assert len(s.sampled) == 0 and running.sampled is None  # its record would mix two weight sets
    assert waiting.draft_dists == [None] and waiting.sampled is not None  # scored again; no output yet: records
    while s.can_step():
        s.step()

    def kept(seq):
        return s.sampled.source_dists(prompt, sibling_source(prompt, seq)) is not None
    assert not kept(prompt + running.output_ids)  # not kept when it finished either
    assert kept(prompt + waiting.output_ids)  # recorded wholly on the new weights
    assert kept(prompt + sibs["s"]["output_ids"]) and s.spec.scored_tokens > 0  # scored again by w, on the new weights


def test_sampled_dists_keep_complete_records_within_their_row_bound():
    from dora_megatron.rollout.engine.sampled_dists import SampledDists, SampledRecord

    def record(prompt_len, n):
        return SampledRecord(prompt_len, torch.full((n, 2), 7), torch.full((n, 2), 0.5))

    kept = SampledDists(max_rows=5)
    kept.keep([1, 2, 3, 4], record(2, 1))  # 2 output tokens, 1 row: incomplete, refused
    assert len(kept) == 0
    kept.keep([1, 2, 3, 4], record(2, 2))
    kept.keep([1, 2, 5, 6, 7], record(2, 3))
    assert (len(kept), kept.rows) == (2, 5)
    kept.keep([1, 2, 8, 9], record(2, 2))  # over the bound: the least recently used goes
    assert kept.source_dists([1, 2], [1, 2, 3, 4]) is None and kept.rows == 5
    d = kept.source_dists([1, 2], [1, 2, 5, 6, 7])
    # after 1 (a prompt token) the source says 2: a point mass; after 2, 5 and 6 the record's rows;
    # after the last token nothing follows (a row the index never uses)
    assert d.ids[0].tolist() == [2, 0] and d.probs[0].tolist() == [1.0, 0.0]
    assert d.ids[1:4].tolist() == [[7, 7]] * 3 and d.start == 0


def test_routed_experts_unchanged_by_speculation(moe_model):
    from dora_megatron.rollout.engine.routing_trace import routing_trace_for

    answers = {}
    for mode in ("off", "ngram"):
        r = _req("a", PROMPTS[0], None, temperature=0.0)
        r.routing = routing_trace_for(moe_model.config, 0)
        s = _sched(moe_model, mode)
        answers[mode] = _run(s, [r])["a"]["meta_info"]["routed_experts"]
        assert mode == "off" or s.spec.verify_steps > 0
    assert answers["ngram"] == answers["off"]


def _oracle_drafter(prompt, reference, wrong: bool, vocab: int):
    """A drafter that knows the greedy continuation: it drafts it (every draft kept) or each of its
    tokens shifted by one (every draft rejected at its first token)."""
    shift = 1 if wrong else 0

    def draft(context, k, sources):
        at = len(context) - len(prompt)
        return [(t + shift) % vocab for t in reference[at : at + k]]

    return draft


@pytest.mark.parametrize("wrong", [True, False])
def test_engine_stops_drafting_what_is_rejected_and_probes_at_a_bounded_rate(moe_model, wrong):
    prompt, n, probe = PROMPTS[1], 40, 6
    ref = _run(_sched(moe_model), [_req("a", prompt, None, n=n, temperature=0.0)])["a"]
    s = Scheduler(moe_model, SchedulerLimits(max_running=4, speculative="ngram", spec_tokens=4, spec_token_cost=0.25,
                                             spec_probe_interval=probe),
                  drafter=_oracle_drafter(prompt, ref["output_ids"], wrong, moe_model.config.vocab_size))
    sink = Collector()
    s.submit(_req("a", prompt, sink, n=n, temperature=0.0))
    verified = []  # per forward pass: was it a verify step?
    while s.can_step():
        before = s.spec.verify_steps
        s.step()
        verified.append(s.spec.verify_steps > before)
    assert sink["a"]["output_ids"] == ref["output_ids"]  # the policy never changes what is generated
    assert _lps(sink["a"]) == pytest.approx(_lps(ref), abs=1e-4)
    if not wrong:  # kept drafts: every decode step verifies, and the request needs few of them
        assert s.spec.declined_steps == 0 and s.spec.accepted_tokens > 0 and len(verified) < n // 2
        return
    assert s.spec.accepted_tokens == 0 and s.spec.declined_steps > 0
    steps = [i for i, v in enumerate(verified) if v]
    first_stop = next(i for i, v in enumerate(verified[1:], 1) if not v)  # step 0 is the prefill
    assert first_stop <= 6, f"kept drafting rejected drafts for {first_stop - 1} verify steps"
    probes = [i for i in steps if i > first_stop]
    assert len(probes) >= 2  # it did probe again ...
    assert all(b - a == probe + 1 for a, b in zip(probes, probes[1:]))  # ... once every probe + 1 steps


def test_engine_drafts_alone_what_it_declines_at_a_batch_of_eight_and_keeps_good_drafts_there(moe_model):
    """Drafts kept one token in two (the first token right, the second wrong): alone, a draft token
    costs spec_token_cost 0.25 of the step and one-token drafts pay (1.5 tokens for 1.25); at a
    running batch of 8 the same token delays 8 requests, 0.25 x 8 / 2.75 = 0.73 of the plain step's
    8 tokens, and no draft pays: each request tries once (a request with no evidence yet probes)
    and then decodes plainly. Drafts that are always right keep drafting at that batch. Outputs
    are identical either way."""
    prompt, n = PROMPTS[1], 24
    ref = _run(_sched(moe_model), [_req("a", prompt, None, n=n, temperature=0.0)])["a"]["output_ids"]
    vocab = moe_model.config.vocab_size

    def half_right(context, k, sources):
        at = len(context) - len(prompt)
        return [t if i == 0 else (t + 1) % vocab for i, t in enumerate(ref[at : at + k])]

    def right(context, k, sources):
        at = len(context) - len(prompt)
        return list(ref[at : at + k])

    verify_steps = {}
    for name, drafter in (("half", half_right), ("right", right)):
        for batch in (1, 8):
            s = Scheduler(moe_model, SchedulerLimits(max_running=8, speculative="ngram", spec_tokens=4,
                                                     spec_max_batch=8, spec_token_cost=0.25, spec_probe_interval=64),
                          drafter=drafter)
            out = _run(s, [_req(f"r{i}", prompt, None, n=n, temperature=0.0) for i in range(batch)])
            assert all(r["output_ids"] == ref for r in out.values())
            verify_steps[name, batch] = s.spec.verify_steps
    assert verify_steps["half", 1] >= n // 3, verify_steps
    assert verify_steps["half", 8] == 8, verify_steps  # one first try per request, none after it
    assert verify_steps["right", 8] >= 8 * (n // 5), verify_steps  # good drafts pay even at a batch of 8
