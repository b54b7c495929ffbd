"""The statistics of ``tools/bench_reprefill.py``: within-repetition ratios, the per-token line, a
run's estimate, and the errors bad timings give."""

from __future__ import annotations

import pytest

from dora_megatron.launch.reprefill_cost import Line, RepTiming, fit_line, length_row, run_estimate, spread


def test_spread_is_median_and_range_and_refuses_nothing():
    s = spread([3.0, 1.0, 10.0, 2.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_ratios_are_taken_within_each_repetition():
    # per repetition re-prefill / decode is 0.1, 0.5, 0.1 (median 0.1); the ratio of the medians
    # (0.4 / 2.0) would be 0.2: a load drift between repetitions must not mix into the ratio
    reps = [RepTiming(32, 10, decode_s=d, reprefill_s=r, warm_s=0.05) for d, r in ((1.0, 0.1), (2.0, 1.0), (4.0, 0.4))]
    row = length_row(reps)
    assert row["reprefill_tokens"] == 42
    assert row["reprefill_over_decode"].median == pytest.approx(0.1)
    assert (row["reprefill_over_decode"].lo, row["reprefill_over_decode"].hi) == pytest.approx((0.1, 0.5))
    assert row["decode_s"].median == 2.0 and row["reprefill_s"].median == 0.4
    # decode steps of 0.1, 0.2, 0.4 s: the re-prefills took 1, 5 and 1 of them
    assert row["reprefill_in_decode_steps"].median == pytest.approx(1.0)
    # (0.1 - 0.05) / 42, (1.0 - 0.05) / 42, (0.4 - 0.05) / 42
    assert row["extra_s_per_token"].median == pytest.approx(0.35 / 42)
    # against not moving: 0.1 - 0.1, 1.0 - 0.2, 0.4 - 0.4
    assert (row["cost_s"].lo, row["cost_s"].median, row["cost_s"].hi) == pytest.approx((0.0, 0.0, 0.8))


def test_length_row_refuses_mixed_lengths_and_bad_timings():
    with pytest.raises(ValueError, match=r"mixes .*\(32, 10\), \(32, 20\)"):
        length_row([RepTiming(32, 10, 1.0, 0.1, 0.05), RepTiming(32, 20, 1.0, 0.1, 0.05)])
    with pytest.raises(ValueError, match="reprefill_s must be > 0, got 0.0"):
        RepTiming(32, 10, 1.0, 0.0, 0.05)
    with pytest.raises(ValueError, match="partial_tokens must be >= 1"):
        RepTiming(32, 0, 1.0, 0.1, 0.05)


def test_fit_line_recovers_a_line_and_needs_two_lengths():
    pts = [(48, 0.02 + 48e-4), (96, 0.02 + 96e-4), (288, 0.02 + 288e-4), (288, 0.02 + 288e-4)]
    line = fit_line(pts)
    assert (line.fixed_s, line.per_token_s) == pytest.approx((0.02, 1e-4))
    with pytest.raises(ValueError, match="two distinct token counts"):
        fit_line([(48, 0.1), (48, 0.2)])


def test_run_estimate_of_a_runs_counters():
    est = run_estimate(Line(0.02, 0.001), moves=1011, tokens=50632, wall_s=585.0, instances=2)
    # 1011 x 20 ms + 50632 x 1 ms = 70.852 s of 585 s, of 1170 instance-seconds
    assert est["reprefill_s"] == pytest.approx(70.852)
    assert est["share_of_wall"] == pytest.approx(0.121114, rel=1e-5)
    assert est["share_of_instance_time"] == pytest.approx(0.060557, rel=1e-4)
    with pytest.raises(ValueError, match="wall_s 0"):
        run_estimate(Line(0.02, 0.001), moves=1, tokens=1, wall_s=0, instances=2)
