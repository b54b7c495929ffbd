"""The running-sum task, its heavy tail and the rule-based rewards."""

from __future__ import annotations

import statistics

import pytest

from dora_megatron.data.tasks import (
    CIPHER, RunningSumTask, digit_cipher_answer, heavy_tail_lengths, make_prompt_source, math_reward, parse_running_sum_prompt, running_sum_answer,
    running_sum_prompt, running_sum_reward,
)


def test_running_sum_answer_by_hand():
    assert running_sum_answer([3, 1, 9]) == "a3b4c3"
    assert running_sum_answer([5, 5, 5, 5]) == "a5b0c5d0"
    assert running_sum_prompt([3, 1, 9]) == "a3b1c9:"
    assert parse_running_sum_prompt("a3b1c9:") == [3, 1, 9]


def test_digit_cipher_answer_by_hand():
    # d -> (3d + 1) mod 10, written out: 3 -> 0, 1 -> 4, 9 -> 8
    assert digit_cipher_answer([3, 1, 9]) == "a0b4c8"
    assert sorted(CIPHER) == sorted("0123456789"), "the substitution must be a permutation"
    assert all(CIPHER[d] == str((3 * d + 1) % 10) for d in range(10))


def test_digit_task_kinds_share_prompts_and_differ_in_answers():
    cipher, rsum = RunningSumTask(seed=3, kind="digit_cipher"), RunningSumTask(seed=3, kind="running_sum")
    for i in range(20):
        a, b = cipher.get(i), rsum.get(i)
        assert a.text == b.text
        assert a.answer == digit_cipher_answer(parse_running_sum_prompt(a.text))
        assert b.answer == running_sum_answer(parse_running_sum_prompt(b.text))
    with pytest.raises(ValueError, match="unknown digit task 'sum'"):
        RunningSumTask(kind="sum")


def test_make_prompt_source_names_bad_task():
    source, reward = make_prompt_source("digit_cipher", min_len=1, max_len=5, exponent=1.2, seed=0)
    p = source.get(7)
    assert reward(p.answer + ".", p.answer) == 1.0
    with pytest.raises(ValueError, match="data.task: unknown task 'nope'"):
        make_prompt_source("nope")


def test_prompts_are_deterministic_and_consistent():
    a, b = RunningSumTask(seed=3), RunningSumTask(seed=3)
    for i in range(50):
        p = a.get(i)
        assert p == b.get(i)
        digits = parse_running_sum_prompt(p.text)
        assert running_sum_answer(digits) == p.answer
    assert RunningSumTask(seed=4).get(0) != RunningSumTask(seed=3).get(0) or RunningSumTask(seed=4).get(1) != RunningSumTask(seed=3).get(1)


@pytest.mark.parametrize("exponent", [1.2, 1.6])
def test_heavy_tail_p99_over_median_at_least_8(exponent):
    task = RunningSumTask(min_len=1, max_len=40, exponent=exponent, seed=0, kind="digit_cipher")
    lengths = sorted(len(RunningSumTask.target(task.get(i))) for i in range(4000))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    assert p99 / median >= 8, (p99, median)


def test_max_len_bounded_by_markers():
    with pytest.raises(ValueError, match="max_len must be <= 52"):
        RunningSumTask(1, 60)


def test_length_weights_normalised_and_decreasing():
    support, weights = heavy_tail_lengths(1, 10, 1.6)
    assert support == list(range(1, 11))
    assert abs(sum(weights) - 1) < 1e-12
    assert all(x > y for x, y in zip(weights, weights[1:]))


def test_running_sum_reward():
    assert running_sum_reward("347.", "347") == 1.0
    assert running_sum_reward("347", "347") == 1.0
    assert running_sum_reward("340.", "347") == 0.0
    assert running_sum_reward("340.", "347", partial_credit=True) == pytest.approx(0.5 * 2 / 3)
    assert running_sum_reward("9", "347", partial_credit=True) == 0.0
    assert running_sum_reward("3478.", "347") < 1.0


def test_math_reward_fallback_or_verify():
    assert math_reward("so the answer is \\boxed{42}", "42") == 1.0
    assert math_reward("so the answer is \\boxed{41}", "42") == 0.0


def test_fallback_math_answers_equal_as_numbers_and_without_thousands_separators():
    from dora_megatron.data.tasks import same_answer

    assert same_answer("1/2", "0.5") and same_answer("\\frac{1}{2}", "0.5") and same_answer("\\dfrac{3}{4}", "3/4")
    assert same_answer("1,000", "1000") and same_answer("$12,345,678$", "12345678")
    assert not same_answer("1,5", "15")  # not a thousands separator
    assert not same_answer("1/3", "0.33") and not same_answer("2", "3")
    assert math_reward("so the answer is \\boxed{1/2}", "0.5") == 1.0  # whichever reward is installed


def test_the_active_reward_is_named():
    from dora_megatron.data.tasks import math_verify_available, reward_description

    assert reward_description("digit_cipher") == "digit_cipher: exact answer"
    name = reward_description("math")
    assert name == "math: math-verify" if math_verify_available() else "math-verify cannot be imported" in name
