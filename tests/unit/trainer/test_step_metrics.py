"""What each of a training step's metrics is averaged over (``trainer/step_metrics.py``): the
reports of one rank added up, the ranks' sums added, then each metric divided by its own count."""

from __future__ import annotations

import pytest

from dora_megatron.trainer.step_metrics import SUM_KEYS, step_metrics, sum_reports


def _reduced(*ranks):
    """What the ranks' all-reduce gives: the element-wise sum of totals, the max of presence."""
    sums = [sum_reports(reports) for reports in ranks]
    return ([sum(col) for col in zip(*(t for t, _ in sums))], [max(col) for col in zip(*(p for _, p in sums))])


def test_the_on_policy_metric_is_over_on_policy_tokens_and_the_rest_over_every_token():
    # one micro-batch of 4 on-policy tokens (logprob diff 0.1 each), one of 6 stale tokens (no diff);
    # entropy 0.5 a token in the first, 1.0 in the second
    fresh = {"loss_sum": 2.0, "denominator": 4.0, "num_tokens": 4, "num_samples": 1, "on_policy_tokens": 4,
             "entropy": 4 * 0.5, "rollout_vs_trainer_logprob_diff": 4 * 0.1}
    stale = {"loss_sum": 3.0, "denominator": 6.0, "num_tokens": 6, "num_samples": 2, "on_policy_tokens": 0,
             "entropy": 6 * 1.0}
    m = step_metrics(*_reduced([fresh], [stale]))  # on two ranks: the same as on one
    assert m == step_metrics(*_reduced([fresh, stale]))
    assert m["rollout_vs_trainer_logprob_diff"] == pytest.approx(0.1)  # not diluted by the stale tokens
    assert m["entropy"] == pytest.approx((4 * 0.5 + 6 * 1.0) / 10)
    assert (m["loss"], m["num_tokens"], m["num_samples"], m["on_policy_tokens"]) == (0.5, 10, 3, 4)


def test_a_metric_no_report_carries_is_left_out_not_reported_as_zero():
    only_stale = {"loss_sum": 1.0, "denominator": 2.0, "num_tokens": 2, "num_samples": 1, "on_policy_tokens": 0,
                  "entropy": 0.0, "rollout_vs_trainer_logprob_diff": 0.0}
    m = step_metrics(*_reduced([only_stale], []))  # a rank that computed no loss adds nothing
    assert m["entropy"] == 0.0 and "clip_fraction" not in m and "tis_weight" not in m
    assert "rollout_vs_trainer_logprob_diff" not in m  # no on-policy token to average it over
    assert set(m) < {"loss", *SUM_KEYS}


def test_an_empty_step_divides_by_one_not_zero():
    assert step_metrics(*sum_reports([])) == {"loss": 0.0, "num_tokens": 0.0, "num_samples": 0.0,
                                              "on_policy_tokens": 0.0}
