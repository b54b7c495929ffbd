"""The decode cost model: roofline shape, and the closed-form span the event loop jumps with."""

import random

import pytest

from dora_megatron.config.sim import CostModelConfig
from dora_megatron.sim.cost import DecodeCost, kv_transfer_s, prefill_s

D = DecodeCost(overhead_s=0.004, weight_s=0.012, kv_s_per_token=5e-8, compute_s_per_seq=1e-4)


def test_step_time_monotonic_in_batch_and_context():
    for ctx in (0, 10_000, 200_000):
        times = [D.step_s(b, ctx) for b in range(1, 400)]
        assert all(a <= b for a, b in zip(times, times[1:]))
    for b in (1, 16, 300):
        times = [D.step_s(b, c) for c in range(0, 500_000, 5_000)]
        assert all(a <= b2 for a, b2 in zip(times, times[1:]))


def test_knee_flat_then_linear():
    ctx = 50_000
    knee = D.knee_batch(ctx)
    assert 10 < knee < 1000
    below = [D.step_s(b, ctx) for b in range(1, int(knee))]
    assert max(below) == pytest.approx(min(below))  # memory-bound: batch does not matter
    b1, b2 = int(knee) + 10, int(knee) + 20
    assert D.step_s(b2, ctx) - D.step_s(b1, ctx) == pytest.approx(10 * D.compute_s_per_seq)


@pytest.mark.parametrize("batch,ctx0", [(1, 0), (8, 1000), (150, 100), (200, 0), (64, 300_000)])
def test_span_equals_explicit_sum(batch, ctx0):
    for steps in (0, 1, 2, 7, 100, 1234):
        explicit = sum(D.step_s(batch, ctx0 + batch * i) for i in range(steps))
        assert D.span_s(batch, ctx0, steps) == pytest.approx(explicit, rel=1e-9, abs=1e-12)


def test_steps_within_inverts_span():
    rng = random.Random(0)
    for _ in range(200):
        b, c0, k = rng.randint(1, 300), rng.randint(0, 100_000), rng.randint(1, 5000)
        budget = rng.uniform(0, D.span_s(b, c0, k) * 1.2)
        n = D.steps_within(b, c0, budget, k)
        assert 0 <= n <= k
        assert D.span_s(b, c0, n) <= budget + 1e-12
        if n < k:
            assert D.span_s(b, c0, n + 1) > budget


def test_prefill_and_transfer_costs_grow_with_tokens():
    cfg = CostModelConfig(prefill_s_per_token2=1e-9)
    assert prefill_s(cfg, 0) == 0
    assert prefill_s(cfg, 2000) > prefill_s(cfg, 1000) > 0
    assert kv_transfer_s(cfg, 10_000) > kv_transfer_s(cfg, 10) > cfg.migration_latency_s
