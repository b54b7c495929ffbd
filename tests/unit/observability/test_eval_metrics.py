"""pass@k (Chen et al. 2021) against its definition: the share of k-subsets of the n samples that
hold at least one passing sample, enumerated by brute force for small n."""

import itertools
import math

import pytest

from dora_megatron.observability.eval_metrics import eval_scalars, pass_at_k, round_metrics


def _brute_force(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_hand_computable_cases():
    assert pass_at_k(5, 0, 3) == 0.0  # nothing passed
    assert pass_at_k(5, 5, 1) == 1.0  # everything passed
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # k = n: did any pass
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k = 1: the pass fraction
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # only {fail, fail} of the C(4,2)=6 pairs misses
    # large n: the product form matches the binomial ratio without overflow
    assert pass_at_k(200, 7, 50) == pytest.approx(1 - math.comb(193, 50) / math.comb(200, 50))


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_round_metrics_average_over_prompts_with_the_threshold():
    # prompt 0: 1 of 2 pass; prompt 1: none (0.5 partial credit is below 1.0); prompt 2: both (-1/1 style)
    m = round_metrics([[1.0, 0.0], [0.5, 0.0], [1.0, 1.0]], k=2, threshold=1.0)
    assert m["mean_reward"] == pytest.approx(3.5 / 6)
    assert m["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@k"] == pytest.approx((1 + 0 + 1) / 3)
    assert (m["k"], m["prompts"], m["samples"], m["passes"]) == (2, 3, 6, [1, 0, 2])
    assert round_metrics([[0.5, 0.0]], k=1, threshold=0.5)["pass@1"] == pytest.approx(0.5)
    assert eval_scalars(m) == {"eval/mean_reward": m["mean_reward"], "eval/pass@1": m["pass@1"],
                               "eval/pass@k": m["pass@k"]}
    with pytest.raises(ValueError, match="at least one prompt"):
        round_metrics([], k=1, threshold=1.0)
