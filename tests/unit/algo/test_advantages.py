import math

import pytest
import torch

from dora_megatron.algo.advantages import compute_advantages, grpo_advantages


def test_group_normalised_by_hand():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 1: rewards 2, 4 -> mean 3, unbiased std sqrt(2)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 4.0])
    groups = [0, 0, 1, 0, 0, 1]
    adv = grpo_advantages(rewards, groups, eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    expected = [0.5 / s0, -0.5 / s0, -1 / s1, -0.5 / s0, 0.5 / s0, 1 / s1]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_no_std_only_centres():
    adv = compute_advantages("grpo_no_std", torch.tensor([3.0, 1.0, 5.0]), [7, 7, 7])
    assert adv.tolist() == pytest.approx([0.0, -2.0, 2.0])


def test_constant_group_and_singleton_get_zero():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 5.0]), [0, 0, 1])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_eps_is_added_to_std():
    adv = grpo_advantages(torch.tensor([0.0, 2.0]), [0, 0], eps=1.0)
    # std = sqrt(2); (2 - 1) / (sqrt(2) + 1)
    assert adv[1].item() == pytest.approx(1 / (math.sqrt(2) + 1), rel=1e-6)


def test_unknown_estimator_and_length_mismatch():
    with pytest.raises(KeyError):
        compute_advantages("nope", torch.tensor([1.0]), [0])
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]), [0])
