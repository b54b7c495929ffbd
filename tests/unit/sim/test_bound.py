"""The deployment bound (sim/bound.py): which capacity binds, how the KV tier and elastic
colocation move it, and that no simulated mode beats it."""

import pytest

from dora_megatron.config.sim import load_sim_config
from dora_megatron.sim.bound import deployment_bound, instance_capacity, length_moments
from dora_megatron.sim.engine import simulate

from tests.helpers.sim import FAST, TINY


def _cfg(mode, *extra):
    return load_sim_config(TINY, FAST + list(extra), mode=mode)


M = length_moments(_cfg("dora"))
M_TAIL = length_moments(_cfg("dora", "workload.max_response_tokens=60000", "workload.response.sigma=2.0"))


def test_instance_capacity_is_kv_bound_until_the_slot_cap():
    roomy = instance_capacity(_cfg("dora").cost, M)
    tight = instance_capacity(_cfg("dora", "cost.kv_capacity_tokens=8000").cost, M)
    assert roomy.concurrency == _cfg("dora").cost.max_concurrent  # 200K tokens of KV: the slot cap binds
    assert tight.concurrency < roomy.concurrency and tight.tokens_per_s < roomy.tokens_per_s
    # a fast host tier gives the KV-bound instance its slots back; a slow one is not used
    fast = instance_capacity(_cfg("dora", "cost.kv_capacity_tokens=8000", "cost.host_kv_capacity_tokens=40000",
                                  "cost.host_kv_bandwidth_Bps=1e12").cost, M)
    slow = instance_capacity(_cfg("dora", "cost.kv_capacity_tokens=8000", "cost.host_kv_capacity_tokens=40000",
                                  "cost.host_kv_bandwidth_Bps=1e8").cost, M)
    assert fast.concurrency > tight.concurrency and fast.tokens_per_s > tight.tokens_per_s
    assert slow.tokens_per_s == pytest.approx(tight.tokens_per_s, rel=0.02)


def test_disaggregated_bound_is_the_smaller_capacity_and_moves_with_the_split():
    few = deployment_bound(_cfg("dora", "cost.kv_capacity_tokens=8000", "cluster.trainer_gpus=2"), M)
    many = deployment_bound(_cfg("dora", "cost.kv_capacity_tokens=8000", "cluster.trainer_gpus=12"), M)
    for b in (few, many):
        assert b.capacity_bound_tokens_per_s == pytest.approx(min(b.rollout_tokens_per_s, b.training_tokens_per_s))
        assert b.bound_tokens_per_s == min(b.capacity_bound_tokens_per_s, b.tail_bound_tokens_per_s)
    assert many.training_tokens_per_s > few.training_tokens_per_s
    assert many.rollout_tokens_per_s < few.rollout_tokens_per_s
    assert few.capacity_bound_tokens_per_s == few.training_tokens_per_s
    assert many.capacity_bound_tokens_per_s == many.rollout_tokens_per_s


def test_colocated_bound_time_shares_both_capacities():
    b = deployment_bound(_cfg("sync"), M)
    assert b.placement == "colocated"
    assert b.capacity_bound_tokens_per_s < min(b.rollout_tokens_per_s, b.training_tokens_per_s)
    assert b.capacity_bound_tokens_per_s == deployment_bound(_cfg("partial"), M).capacity_bound_tokens_per_s


def test_the_staleness_window_bounds_a_long_tail():
    """Every group must finish within S steps of its version (S+1 rollout phases colocated): the
    slowest sample of a batch, decoded alone, caps the step rate whatever the capacity."""
    tail = ["workload.max_response_tokens=60000", "workload.response.sigma=2.0"]
    sync = deployment_bound(_cfg("sync", *tail), M_TAIL)
    assert sync.binding == "tail" and sync.bound_tokens_per_s < sync.capacity_bound_tokens_per_s
    s1 = deployment_bound(_cfg("dora", *tail, "orchestrator.max_staleness=1"), M_TAIL)
    s4 = deployment_bound(_cfg("dora", *tail, "orchestrator.max_staleness=4"), M_TAIL)
    assert s1.binding == "tail"
    assert s4.tail_bound_tokens_per_s == pytest.approx(4 * s1.tail_bound_tokens_per_s)
    assert s4.bound_tokens_per_s > s1.bound_tokens_per_s


def test_elastic_colocation_lifts_a_rollout_bound_deployment():
    roll_bound = ["cost.kv_capacity_tokens=8000", "cost.train_fixed_s=30", "cost.colocated_switch_s=2"]
    plain = deployment_bound(_cfg("dora", *roll_bound), M)
    elastic = deployment_bound(_cfg("dora", *roll_bound, "cluster.elastic_colocation=true"), M)
    assert plain.binding == "rollout"
    assert elastic.elastic_instances > 0
    assert plain.bound_tokens_per_s < elastic.bound_tokens_per_s <= elastic.training_tokens_per_s


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
def test_no_mode_beats_the_bound(mode):
    """The bound is for the workload's mean batch; a 16-group batch's tokens vary by ~10%, so the
    simulated rate is compared per token of the batches it actually consumed."""
    for extra in ([], ["cost.kv_capacity_tokens=8000"], ["workload.max_response_tokens=2000"]):
        cfg = _cfg(mode, *extra)
        res = simulate(cfg)
        b = deployment_bound(cfg, length_moments(cfg))
        window = res.series["tokens"][cfg.sim.warmup_steps:]
        batch = sum(window) / len(window)
        thr = res.summary["throughput_tokens_per_s"] * b.tokens_per_step / batch
        assert 0 < thr <= b.bound_tokens_per_s <= b.capacity_bound_tokens_per_s, extra
