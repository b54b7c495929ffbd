"""The decode cost model: roofline shape, and the closed-form span the event loop jumps with."""

import random

import pytest

from dora_megatron.config.sim import CostModelConfig
from dora_megatron.sim.cost import (DecodeCost, host_kv_hidden_tokens, host_kv_spill_s, kv_admit_tokens, kv_transfer_s,
                                   prefill_s)

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


# ---------------------------------------------------------------- host KV tier
TIER = CostModelConfig(kv_capacity_tokens=100_000, host_kv_capacity_tokens=200_000,
                       kv_bytes_per_token=65_536.0, host_kv_bandwidth_Bps=5e10)
DT = DecodeCost.from_config(TIER)


def test_no_spill_below_device_capacity_and_without_a_tier():
    assert host_kv_spill_s(TIER, 0) == 0.0
    assert host_kv_spill_s(TIER, 100_000) == 0.0
    no_tier = CostModelConfig(kv_capacity_tokens=100_000, host_kv_capacity_tokens=0)
    assert host_kv_spill_s(no_tier, 250_000) == 0.0
    # below device capacity the tier changes nothing: same step times as without it
    plain = DecodeCost.from_config(no_tier)
    for b, ctx in ((1, 0), (40, 60_000), (300, 99_000)):
        assert DT.step_s(b, ctx) == plain.step_s(b, ctx)


def test_spill_time_grows_with_spilled_bytes_over_bandwidth():
    s1, s2 = host_kv_spill_s(TIER, 110_000), host_kv_spill_s(TIER, 130_000)
    assert 0 < s1 < s2
    assert s2 == pytest.approx(3 * s1)  # 30K spilled tokens vs 10K
    fast = CostModelConfig(kv_capacity_tokens=100_000, host_kv_capacity_tokens=200_000,
                           kv_bytes_per_token=65_536.0, host_kv_bandwidth_Bps=2e11)
    assert host_kv_spill_s(fast, 130_000) == pytest.approx(s2 / 4)
    fat = CostModelConfig(kv_capacity_tokens=100_000, host_kv_capacity_tokens=200_000,
                          kv_bytes_per_token=131_072.0, host_kv_bandwidth_Bps=5e10)
    assert host_kv_spill_s(fat, 130_000) == pytest.approx(2 * s2)


def test_spill_hides_under_hbm_time_then_slows_the_step():
    hidden = host_kv_hidden_tokens(TIER)
    assert hidden > 0
    full = DT.step_s(8, 100_000)
    assert DT.step_s(8, 100_000 + 0.9 * hidden) == pytest.approx(full)  # overlapped with the HBM reads
    assert DT.step_s(8, 100_000 + 2 * hidden) > 1.5 * full


@pytest.mark.parametrize("batch,ctx0", [(1, 99_990), (8, 50_000), (64, 90_000), (300, 0), (16, 180_000)])
def test_tiered_span_equals_explicit_sum(batch, ctx0):
    for steps in (0, 1, 2, 7, 100, 1234, 5000):
        explicit = sum(DT.step_s(batch, ctx0 + batch * i) for i in range(steps))
        assert DT.span_s(batch, ctx0, steps) == pytest.approx(explicit, rel=1e-9, abs=1e-12)


def test_admission_counts_the_host_tier():
    assert kv_admit_tokens(TIER) == 300_000
    assert kv_admit_tokens(CostModelConfig(kv_capacity_tokens=100_000)) == 100_000


def test_host_tier_keys_are_validated_by_name():
    from pathlib import Path

    from dora_megatron.config.base import ConfigError
    from dora_megatron.config.sim import load_sim_config

    tiny = Path(__file__).resolve().parents[3] / "configs" / "sim" / "tiny.yaml"
    with pytest.raises(ConfigError, match="cost.host_kv_bandwidth_Bps"):
        load_sim_config(tiny, ["cost.host_kv_bandwidth_Bps=0"])
    with pytest.raises(ConfigError, match="cost.host_kv_capacity_tokens"):
        load_sim_config(tiny, ["cost.host_kv_capacity_tokens=-1"])
