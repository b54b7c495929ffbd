"""``tools/bench_speculative.py``'s two-candidate kept rate: what the first level of a width-2 draft
tree would keep, the number the speculation results use to say whether a tree would lift the
acceptance bound. Each case is worked out by hand from the rejection rule."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tools import load_tool

bench = load_tool("bench_speculative")


def dist(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_a_draft_drawn_from_the_target_is_always_kept():
    assert bench.two_candidate_kept(dist(0.2, 0.3, 0.5), {0: 0.2, 1: 0.3, 2: 0.5}) == pytest.approx(1.0)


def test_one_possible_candidate_is_kept_with_its_target_probability():
    assert bench.two_candidate_kept(dist(0.2, 0.7, 0.1), {1: 1.0}) == pytest.approx(0.7)


def test_the_second_candidate_takes_what_the_first_one_missed():
    # p is all on token 0, q splits between 0 and 1: the first draw is kept half the time; a
    # rejected first draw (token 1) leaves residual all on 0, and the second candidate is then 0
    assert bench.two_candidate_kept(dist(1.0, 0.0), {0: 0.5, 1: 0.5}) == pytest.approx(1.0)


def test_a_second_candidate_outside_the_residual_adds_nothing():
    # p = (0.5, 0.5, 0), q = (0, 0.5, 0.5): token 1 is kept; token 2 is refused, the residual is
    # all on token 0, which q cannot propose: one in two, as with a single candidate
    assert bench.two_candidate_kept(dist(0.5, 0.5, 0.0), {1: 0.5, 2: 0.5}) == pytest.approx(0.5)


def test_two_candidates_keep_at_least_what_one_keeps():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        p = torch.softmax(torch.randn(12, generator=gen) * 2, -1)
        raw = torch.rand(5, generator=gen)
        q = {int(t): float(w) for t, w in zip(torch.randperm(12, generator=gen)[:5], raw / raw.sum())}
        one = sum(min(float(p[t]), w) for t, w in q.items())
        assert one - 1e-6 <= bench.two_candidate_kept(p, q) <= 1.0 + 1e-6
