"""The per-request speculation policy (``rollout/speculation.py``): a request drafts while its
drafts pay, stops after a few rejected ones, and probes again at a bounded rate."""

from __future__ import annotations

import pytest

from dora_megatron.rollout.speculation import (
    DraftAcceptance,
    batch_token_cost,
    best_draft_length,
    expected_tokens_per_verify,
    observe_decode,
    observe_verify,
    plan_draft,
)

K, COST, PROBE = 4, 0.25, 8


def _after(verifies: list[tuple[int, bool]], state: DraftAcceptance | None = None) -> DraftAcceptance:
    """The state after verify steps of ``K`` drafted tokens, each ``(accepted, rejected)``."""
    state = state or DraftAcceptance()
    for accepted, rejected in verifies:
        state = observe_verify(state, K, accepted, rejected)
    return state


def test_a_draft_length_is_chosen_only_where_it_beats_a_plain_step():
    assert best_draft_length(1.0, K, COST) == K  # every draft token kept: the longest draft
    assert best_draft_length(0.0, K, COST) == 0  # none kept: a verify step only costs
    assert best_draft_length(0.3, K, 0.0) == K  # free draft tokens: drafting never loses
    lengths = [best_draft_length(a / 20, K, COST) for a in range(21)]
    assert lengths == sorted(lengths)  # better acceptance never shortens the draft
    assert 0 < lengths.index(K)  # and between "never" and "always" there is a threshold


def test_new_request_drafts_and_keeps_drafting_while_drafts_are_kept():
    assert plan_draft(DraftAcceptance(), K, COST, PROBE) > 0  # the prior lets it try
    state = _after([(K, False)] * 20)
    assert plan_draft(state, K, COST, PROBE) == K
    assert plan_draft(state, 2, COST, PROBE) == 2  # never longer than the room it is given
    assert plan_draft(state, 0, COST, PROBE) == 0


def test_rejected_drafts_stop_drafting_within_a_few_verify_steps_and_probes_are_bounded():
    state, verifies = DraftAcceptance(), 0
    while plan_draft(state, K, COST, PROBE):
        state = _after([(0, True)], state)
        verifies += 1
        assert verifies <= 5, "drafts that are always rejected must stop being drafted"
    for _ in range(3):  # each probe is rejected: exactly one verify step per PROBE + 1 steps
        for _ in range(PROBE):
            assert plan_draft(state, K, COST, PROBE) == 0
            state = observe_decode(state)
        assert plan_draft(state, K, COST, PROBE) == K  # the probe
        state = _after([(0, True)], state)


def test_a_request_whose_text_turns_repetitive_resumes_drafting_after_probes():
    state = _after([(0, True)] * 30)  # long stopped: the estimate carries much rejection evidence
    probes = 0
    while True:
        for _ in range(PROBE):
            state = observe_decode(state)
        state = _after([(K, False)], state)  # the probe's draft is kept whole
        probes += 1
        if plan_draft(state, K, COST, PROBE) > 0 and state.steps_since_verify == 0:
            break
        assert probes <= 3, "forgetting must let a few good probes restart drafting"


def test_only_tried_tokens_count():
    # a request that ended inside an accepted run saw no rejection: nothing counts against drafting
    assert observe_verify(DraftAcceptance(), K, 2, rejected=False).alpha > DraftAcceptance().alpha
    assert observe_verify(DraftAcceptance(), K, 2, rejected=True).alpha < observe_verify(
        DraftAcceptance(), K, 2, rejected=False).alpha
    with pytest.raises(ValueError, match="cannot accept 5"):
        observe_verify(DraftAcceptance(), K, 5, rejected=False)
    with pytest.raises(ValueError, match="cannot accept 4"):
        observe_verify(DraftAcceptance(), K, K, rejected=True)


def test_state_round_trips_and_bad_exports_are_refused():
    state = observe_decode(_after([(1, True), (K, False)]))
    assert DraftAcceptance.from_json(state.to_json()) == state
    for bad in ([1.0, 0.5, 0], [-1, 2, 0], [1, 2], "x", [True, 2, 0], [1, float("inf"), 0]):
        with pytest.raises(ValueError, match="spec_acceptance"):
            DraftAcceptance.from_json(bad)


def _step_rate(batch: int, drafts: list[int], alpha: float, c: float) -> float:
    """Tokens per lone-decode-step of time of one step of ``batch`` requests, ``drafts[i]`` draft
    tokens for request i, when each of the step's positions costs ``c`` beyond the first."""
    positions = batch + sum(drafts)
    tokens = sum(expected_tokens_per_verify(k, alpha) for k in drafts) + batch - len(drafts)
    return tokens / (1.0 + c * (positions - 1))


@pytest.mark.parametrize("c", [0.05, 0.1, 0.25])
def test_a_request_drafts_at_a_batch_exactly_where_its_draft_raises_the_step_token_rate(c):
    """The policy's batch-aware cost against the step itself: one request of a batch drafts iff
    some draft length makes the whole step yield more tokens per unit of time than the plain step
    (the other requests decoding plainly)."""
    for batch in (1, 2, 3, 5, 8, 16):
        for alpha in [a / 40 for a in range(40)]:
            pays = any(_step_rate(batch, [k], alpha, c) > _step_rate(batch, [0], alpha, c) * (1 + 1e-12)
                       for k in range(1, K + 1))
            assert (best_draft_length(alpha, K, c, batch) > 0) == pays, (batch, alpha)


def test_a_draft_token_costs_more_the_larger_the_batch_it_delays():
    assert batch_token_cost(0.1, 1) == pytest.approx(0.1)  # alone: the configured cost
    costs = [batch_token_cost(0.1, b) for b in range(1, 200)]
    assert costs == sorted(costs) and costs[-1] < 1.0  # rising towards a whole token (c < 1), never past it
    assert batch_token_cost(0.0, 64) == 0.0  # free positions stay free at any batch
    assert best_draft_length(0.5, K, 0.25, 1) > 0 and best_draft_length(0.5, K, 0.25, 8) == 0
    # a request with no evidence tries once at any batch, and a rejected try settles it there
    assert plan_draft(DraftAcceptance(), K, 0.25, PROBE, running_batch=8) == K
    assert plan_draft(_after([(1, True)]), K, 0.25, PROBE, running_batch=8) == 0
    with pytest.raises(ValueError, match="spec_token_cost"):
        batch_token_cost(-0.1, 1)
