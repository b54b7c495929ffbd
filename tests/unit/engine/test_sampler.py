"""Sampling semantics: greedy, seeded reproducibility, top-k/top-p truncation, reported logprobs."""

from __future__ import annotations

import torch

import pytest

from dora_megatron.rollout.engine.sampler import (DRAW_BLOCK, draw_index, locate_index, make_generator, pick_index,
                                                  running_sum, sample_token,
                                                  truncate_probs)
from dora_megatron.comm.protocol import SamplingParams
from tests.helpers.stats import gof_pvalue

LOGITS = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, 1.9])


def test_greedy_is_argmax_with_raw_logprob():
    tok, lp = sample_token(LOGITS, SamplingParams(temperature=0.0), make_generator(0))
    assert tok == 1
    assert abs(lp - float(torch.log_softmax(LOGITS, -1)[1])) < 1e-6


def test_seeded_sampling_is_reproducible_and_logprob_uses_temperature():
    p = SamplingParams(temperature=0.7, sampling_seed=11)
    g1, g2 = make_generator(11), make_generator(11)
    a = [sample_token(LOGITS, p, g1) for _ in range(50)]
    b = [sample_token(LOGITS, p, g2) for _ in range(50)]
    assert a == b
    assert len({t for t, _ in a}) > 1
    ref = torch.log_softmax(LOGITS / 0.7, -1)
    assert all(abs(lp - float(ref[t])) < 1e-6 for t, lp in a)


def test_generator_state_resumes_stream():
    p = SamplingParams(temperature=1.0)
    g = make_generator(5)
    first = [sample_token(LOGITS, p, g)[0] for _ in range(10)]
    state = g.get_state()
    rest = [sample_token(LOGITS, p, g)[0] for _ in range(10)]
    g2 = torch.Generator()
    g2.set_state(state)
    assert [sample_token(LOGITS, p, g2)[0] for _ in range(10)] == rest
    assert first  # stream had started


def test_top_k_and_top_p_only_sample_allowed_tokens():
    g = make_generator(3)
    toks_k = {sample_token(LOGITS, SamplingParams(temperature=1.0, top_k=2), g)[0] for _ in range(200)}
    assert toks_k == {1, 5}
    probs = torch.softmax(LOGITS, -1)
    kept = truncate_probs(probs, -1, 0.5)
    # the nucleus of mass 0.5 holds the two largest tokens (1: 0.33, 5: 0.30)
    assert set(torch.nonzero(kept).flatten().tolist()) == {1, 5}
    assert abs(float(kept.sum()) - 1.0) < 1e-6


def test_draw_index_draws_in_proportion_and_never_a_zero_weight():
    """Unnormalised weights with zeros at both ends and inside. Power: 20,000 draws; moving 0.02
    of probability between two indices is rejected at alpha 0.001 with probability > 0.999."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 2.5, 0.0])
    g = make_generator(9)
    counts = torch.zeros(len(weights))
    for _ in range(20_000):
        counts[draw_index(weights, g)] += 1
    assert counts[weights == 0].sum() == 0
    assert gof_pvalue(counts, weights) > 1e-3
    bad = torch.zeros(len(weights))
    bad[1], bad[3] = 0.02 * 7.0, -0.02 * 7.0  # the alternative of the power statement
    assert gof_pvalue(counts, weights + bad) < 1e-3


def test_draw_index_refuses_weights_without_mass():
    with pytest.raises(ValueError, match="positive mass"):
        draw_index(torch.zeros(4), make_generator(0))


def test_a_token_far_below_float32_steps_keeps_its_own_interval():
    """A weight of 2**-26 between two of 0.5: a float32 running sum rounds it away (0.5 + 2**-26
    is 0.5 in float32), so that token could never be drawn; the engine's running sum keeps its
    interval, and a point inside it picks it."""
    weights = torch.tensor([0.5, 2.0**-26, 0.5])
    assert float(weights.cumsum(0)[1]) == 0.5  # what float32 does
    cum = running_sum(weights)
    assert float(cum[1] - cum[0]) == 2.0**-26
    assert pick_index(cum, 0.5 + 2.0**-28, weights) == 1
    assert pick_index(cum, 0.5 - 2.0**-28, weights) == 0
    assert pick_index(cum, 0.5 + 2.0**-25, weights) == 2
    assert pick_index(cum, float(cum[-1]), torch.tensor([0.5, 2.0**-26, 0.5])) == 2  # rounded up to the total


def test_a_vocabulary_sized_vector_is_located_block_by_block_exactly():
    """Past one block the search goes block by block: the tiny weight keeps its interval there
    too (placed just after a block boundary and inside a block), zero weights are never
    returned, a point past the total gives the last index with weight, and draws over a
    vocabulary of 3 blocks and a partial one follow the weights (20,000 draws; moving 0.02 of
    probability between two cells is rejected at alpha 0.001 with probability > 0.999)."""
    n = 3 * DRAW_BLOCK + 100
    weights = torch.zeros(n)
    weights[[5, DRAW_BLOCK, DRAW_BLOCK + 1, 2 * DRAW_BLOCK + 7, 3 * DRAW_BLOCK + 50]] = torch.tensor(
        [0.5, 2.0**-26, 0.25, 2.0**-26, 0.25])
    total = 1.0 + 2.0**-25
    assert locate_index(weights, (0.5 + 2.0**-28) / total) == DRAW_BLOCK
    assert locate_index(weights, (0.5 - 2.0**-28) / total) == 5
    assert locate_index(weights, (0.75 + 2.0**-26 + 2.0**-28) / total) == 2 * DRAW_BLOCK + 7
    assert locate_index(weights, 0.999999) == 3 * DRAW_BLOCK + 50
    assert locate_index(weights, 1.0) == 3 * DRAW_BLOCK + 50  # rounding at the total
    g = make_generator(21)
    counts = torch.zeros(n)
    for _ in range(20_000):
        counts[draw_index(weights, g)] += 1
    assert gof_pvalue(counts, weights) > 1e-3  # also asserts no zero weight came out
