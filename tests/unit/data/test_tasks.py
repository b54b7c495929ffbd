"""The running-sum task, its heavy tail, rewards, and the JSONL loader."""

from __future__ import annotations

import json
import statistics

import pytest

from dora_megatron.data.tasks import (
    JsonlPromptSource, RunningSumTask, heavy_tail_lengths, math_reward, parse_running_sum_prompt, running_sum_answer,
    running_sum_prompt, running_sum_reward,
)


def test_running_sum_answer_by_hand():
    assert running_sum_answer([3, 1, 9]) == "a3b4c3"
    assert running_sum_answer([5, 5, 5, 5]) == "a5b0c5d0"
    assert running_sum_prompt([3, 1, 9]) == "a3b1c9:"
    assert parse_running_sum_prompt("a3b1c9:") == [3, 1, 9]


def test_prompts_are_deterministic_and_consistent():
    a, b = RunningSumTask(seed=3), RunningSumTask(seed=3)
    for i in range(50):
        p = a.get(i)
        assert p == b.get(i)
        digits = parse_running_sum_prompt(p.text)
        assert running_sum_answer(digits) == p.answer
    assert RunningSumTask(seed=4).get(0) != RunningSumTask(seed=3).get(0) or RunningSumTask(seed=4).get(1) != RunningSumTask(seed=3).get(1)


def test_heavy_tail_p99_over_median_at_least_8():
    task = RunningSumTask(min_len=1, max_len=40, exponent=1.6, seed=0)
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


def test_jsonl_loader_and_errors(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n\n" +
                    json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}) + "\n")
    src = JsonlPromptSource(good)
    assert src.get(0).text == "1+1?" and src.get(1).answer == "4" and src.get(2).text == "1+1?"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'answer'"):
        JsonlPromptSource(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{nope\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: invalid JSON"):
        JsonlPromptSource(broken)


def test_math_reward_fallback_or_verify():
    assert math_reward("so the answer is \\boxed{42}", "42") == 1.0
    assert math_reward("so the answer is \\boxed{41}", "42") == 0.0
