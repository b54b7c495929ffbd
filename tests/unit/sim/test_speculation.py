"""Speculative decoding in the simulator: the engine's policy, the expected yield of a verify step
against a Monte-Carlo run of the rejection rule, the verify cost from the per-step model, and its
effect on a lone long request and on a whole run (whose invariants must still hold)."""

import math
import random

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.sim import CostModelConfig, SimRolloutConfig, load_sim_config
from dora_megatron.rollout.speculation import best_draft_length, expected_tokens_per_verify, should_speculate
from dora_megatron.sim.bound import deployment_bound
from dora_megatron.sim.cost import DecodeCost, DecodeModel
from dora_megatron.sim.engine import Simulation
from dora_megatron.sim.instance import SimInstance, SimRequest
from tests.helpers.sim import FAST, TINY, assert_run_invariants


# ------------------------------------------------------------------ policy
@pytest.mark.parametrize("mode", ["ngram", "group"])
def test_policy_speculates_only_at_small_non_empty_batches(mode):
    assert [should_speculate(mode, b, 4) for b in range(7)] == [False, True, True, True, True, False, False]


def test_policy_off_never_speculates_and_unknown_mode_is_refused():
    assert not any(should_speculate("off", b, 64) for b in range(70))
    with pytest.raises(ValueError, match="rollout.speculative"):
        should_speculate("eagle", 1, 4)


def test_config_refuses_an_unknown_drafter_by_name():
    with pytest.raises(ConfigError, match="rollout.speculative"):
        load_sim_config(TINY, FAST + ["rollout.speculative=eagle"])


# --------------------------------------------- expected tokens vs Monte Carlo
def _verify_step_monte_carlo(rng: random.Random, k: int, alpha: float) -> int:
    """One verify step by the standard rejection rule (draft x ~ q, keep with prob min(1, p(x)/q(x));
    on a rejection sample the residual max(0, p - q), after a full draft one bonus token from p).
    Target p = (alpha, 1 - alpha, 0) and draft q = (alpha, 0, 1 - alpha) over three tokens, so a
    draft token is accepted with probability sum(min(p, q)) = alpha."""
    p, q = (alpha, 1.0 - alpha, 0.0), (alpha, 0.0, 1.0 - alpha)
    tokens = 0
    for _ in range(k):
        x = rng.choices(range(3), weights=q)[0]
        if rng.random() < min(1.0, p[x] / q[x]):
            tokens += 1
        else:
            return tokens + 1  # the residual's token replaces the rejected one
    return tokens + 1  # bonus token


@pytest.mark.parametrize("k,alpha", [(1, 0.5), (4, 0.6), (4, 0.85), (8, 0.9), (3, 0.2)])
def test_expected_tokens_per_verify_matches_the_rejection_rule(k, alpha):
    rng = random.Random(1234 + k)
    n = 20000
    draws = [_verify_step_monte_carlo(rng, k, alpha) for _ in range(n)]
    mean = sum(draws) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / (n - 1))
    # 4 standard errors: a false failure about once in 16,000 runs; the seeds are fixed anyway
    assert abs(expected_tokens_per_verify(k, alpha) - mean) < 4 * sd / math.sqrt(n) + 1e-12


def test_expected_tokens_per_verify_at_the_ends():
    assert expected_tokens_per_verify(5, 0.0) == 1.0
    assert expected_tokens_per_verify(5, 1.0) == 6.0
    assert expected_tokens_per_verify(0, 0.7) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens_per_verify(4, 1.5)


# ------------------------------------------------------------ verify cost
D = DecodeCost(overhead_s=0.004, weight_s=0.012, kv_s_per_token=5e-8, compute_s_per_seq=1e-4)


def test_verify_step_is_a_decode_step_of_k_plus_one_tokens_per_request():
    k, alpha, extra = 4, 0.8, 0.001
    e = expected_tokens_per_verify(k, alpha)
    v = D.verify(k, alpha, extra)
    # memory-bound (batch 2): the weights and the KV are read once, so a verify step costs a decode step
    assert v.step_s(2, 10_000) * e == pytest.approx(D.step_s(2, 10_000) + extra)
    # compute-bound (batch 400): the batch's tokens are multiplied by k+1
    assert v.step_s(400, 10_000) * e == pytest.approx(D.overhead_s + 400 * (k + 1) * D.compute_s_per_seq + extra)
    assert 400 * (k + 1) * D.compute_s_per_seq > D.weight_s + D.kv_s_per_token * 10_000
    # the closed-form span is still the sum of its steps (context grows by the batch per token)
    steps = 300
    assert v.span_s(3, 5_000, steps) == pytest.approx(sum(v.step_s(3, 5_000 + 3 * i) for i in range(steps)))


def test_decode_model_switches_at_the_batch_threshold():
    cost = CostModelConfig()
    off = DecodeModel.from_config(cost, SimRolloutConfig())
    assert off.spec is None and off.for_batch(1) is off.plain
    on = DecodeModel.from_config(cost, SimRolloutConfig(speculative="group", spec_tokens=4, spec_max_batch=3))
    assert on.tokens_per_verify == pytest.approx(expected_tokens_per_verify(4, cost.spec_acceptance.group))
    assert [on.speculates(b) for b in (1, 3, 4, 64)] == [True, True, False, False]
    assert on.for_batch(4) is on.plain and on.for_batch(1) is on.spec


def test_the_draft_length_at_each_batch_is_one_the_charged_cost_rewards():
    """With its own step cost (spec_token_cost null) the simulated policy drafts at a batch only
    where the verify step it is then charged yields tokens faster than plain decode steps, and
    declines where none would: checked against the charged per-token step times themselves."""
    cost = CostModelConfig(max_concurrent=1024)
    model = DecodeModel.from_config(cost, SimRolloutConfig(speculative="group", spec_tokens=4, spec_max_batch=1024))
    plain = model.plain
    alpha, extra = cost.spec_acceptance.group, cost.spec_verify_overhead_s
    for b in (1, 8, 32, 100, 200, 400, 1024):
        per_token = {k: plain.verify(k, alpha, extra).step_s(b, 0) for k in range(1, 5)}
        k = model.draft_tokens_at(b)
        if k:
            assert per_token[k] == min(per_token.values()) < plain.step_s(b, 0), b
        else:
            assert min(per_token.values()) >= plain.step_s(b, 0), b
    drafts = [model.draft_tokens_at(b) for b in range(1, 1025)]
    assert drafts[0] == 4 and drafts == sorted(drafts, reverse=True) and drafts[-1] == 0  # stops past the knee
    # memory-bound: a verify step of 16 x 5 tokens (9.6 ms of compute) costs a decode step plus the
    # verify overhead, so the longest draft pays; at 32 x 5 (19.2 ms) compute binds and it shortens
    assert model.draft_tokens_at(16) == 4 and model.draft_tokens_at(32) < 4
    # no decision beyond what an instance can hold (cost.max_concurrent)
    held = DecodeModel.from_config(CostModelConfig(max_concurrent=20),
                                   SimRolloutConfig(speculative="group", spec_tokens=4, spec_max_batch=1024))
    assert len(held.drafts) == 20 and held.largest_speculating_batch == 20 and held.draft_tokens_at(21) == 0


def test_the_engine_linear_cost_can_be_simulated_instead():
    cost = CostModelConfig()
    rollout = SimRolloutConfig(speculative="group", spec_tokens=4, spec_max_batch=64, spec_token_cost=0.25)
    model = DecodeModel.from_config(cost, rollout)
    alpha = cost.spec_acceptance.group
    assert [model.draft_tokens_at(b) for b in range(1, 65)] == [best_draft_length(alpha, 4, 0.25, b)
                                                                for b in range(1, 65)]
    assert model.largest_speculating_batch < 64  # the linear cost stops it well before the knee


# ------------------------------------------------------- the simulator
def _lone_request_s(rollout: SimRolloutConfig, alpha: float, tokens: int = 20_000) -> float:
    cost = CostModelConfig(kv_capacity_tokens=10**6)
    cost.spec_acceptance.ngram = alpha
    inst = SimInstance("r0", 0, cost, DecodeModel.from_config(cost, rollout))
    inst.add(SimRequest("s0", "g0", 0, prompt_tokens=500, target_tokens=tokens), 0.0, prefill_tokens=500)
    t = inst.next_wake()
    done = inst.sync(t, wake=True)
    assert [r.sample_id for r in done] == ["s0"] and done[0].generated == tokens
    return t


def test_lone_long_request_finishes_sooner_with_speculation_and_poor_drafts_cost_nothing():
    spec = SimRolloutConfig(speculative="ngram", spec_tokens=4, spec_max_batch=8)
    plain = _lone_request_s(SimRolloutConfig(), 0.9)
    fast = _lone_request_s(spec, 0.9)
    e = expected_tokens_per_verify(4, 0.9)
    assert fast < plain / 2  # E = 4.1 tokens per verify step at about the price of a decode step
    # drafts never kept: the policy does not draft, so the simulated request loses nothing; drafts
    # kept 15% of the time pay alone on a memory-bound step (a verify step costs 1.03 decode steps)
    # but not at the embedded engine's linear cost of 0.25 per draft token
    assert _lone_request_s(spec, 0.0) == plain and _lone_request_s(spec, 0.15) < plain
    linear = SimRolloutConfig(speculative="ngram", spec_tokens=4, spec_max_batch=8, spec_token_cost=0.25)
    assert _lone_request_s(linear, 0.15) == plain
    cost = CostModelConfig()
    assert fast == pytest.approx((plain - 500 * cost.prefill_s_per_token) / e
                                 + 500 * cost.prefill_s_per_token + 20_000 * cost.spec_verify_overhead_s / e, rel=1e-6)


@pytest.mark.parametrize("mode", ["sync", "dora"])
def test_a_run_with_speculation_keeps_exactly_once_and_tbs_and_speeds_up_the_tail(mode):
    base = load_sim_config(TINY, FAST, mode=mode)
    spec = load_sim_config(TINY, FAST + ["rollout.speculative=group", "rollout.spec_max_batch=4",
                                         "cost.spec_acceptance.group=0.9"], mode=mode)
    sims = [Simulation(base), Simulation(spec)]
    (r0, r1) = [s.run() for s in sims]
    for sim, res in zip(sims, (r0, r1)):
        assert_run_invariants(sim, res, steps=6)
    sp = r1.extra["speculation"]
    assert r0.extra["speculation"]["speculative_tokens"] == 0
    assert 0 < sp["speculative_token_share"] < 1 and sp["tokens_per_verify_step"] == pytest.approx(
        expected_tokens_per_verify(4, 0.9))
    assert r1.summary["throughput_tokens_per_s"] > r0.summary["throughput_tokens_per_s"]
    # the bound moves with speculation: a batch's slowest sample, decoded alone, speculates
    assert deployment_bound(spec).tail_s < deployment_bound(base).tail_s
