"""The orchestrator's lookup tables (:class:`~dora_megatron.orchestrator.index.PoolIndex`) always
equal what a from-scratch derivation from the records gives (``PoolIndex.rebuild``: each table by
its definition over ``samples``, ``groups`` and ``instances``), after every event of random runs
in every mode, with failures, joins, failed migrations, dual-version tails and a checkpoint round
trip. A mutant index that forgets one update is caught, so the check can fail."""

import json

import pytest
from hypothesis import HealthCheck, given, settings

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.orchestrator.index import PoolIndex
from tests.helpers.orchestrator_scenarios import scenarios

from .sim_driver import Driver


class Inconsistent(AssertionError):
    pass


def check_index(o: Orchestrator) -> None:
    """The kept tables equal the derived ones; the counts no record holds add up."""
    ix = o.index
    kept = ix.tables()
    derived = PoolIndex.rebuild(o.instances, o.samples, o.groups, ix.cap, ix.dispatched, ix.consumed,
                                ix.finished_groups, ix.pending).tables()
    diff = {k: (kept[k], derived[k]) for k in kept if kept[k] != derived[k]}
    if diff:
        raise Inconsistent(f"index differs from the records: {diff}")
    if ix.total_dispatched - ix.total_consumed != len(o.groups):
        raise Inconsistent(f"{ix.total_dispatched} dispatched - {ix.total_consumed} consumed != {len(o.groups)} held")
    if sum(ix.dispatched.values()) != ix.total_dispatched or sum(ix.consumed.values()) != ix.total_consumed:
        raise Inconsistent("per-version counts do not add up to the totals")


class Checked(Orchestrator):
    """Checks its index at the end of every event that can change it."""

    checks = 0

    def _fill(self):
        out = super()._fill()
        check_index(self)
        Checked.checks += 1
        return out


def _driver(sc, cls=Checked):
    d = Driver(sc["cfg"], sc["n_instances"], sc["seed"], fail_prob=sc["fail_prob"], join_prob=sc["join_prob"],
               tail_alpha=sc["tail_alpha"], migration_fail_prob=sc["migration_fail_prob"])
    d.orch = cls(sc["cfg"], list(d.engines))
    return d


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_index_equals_its_derivation_after_every_event(sc):
    before = Checked.checks
    d = _driver(sc)
    d.run(max(1, sc["steps"] // 2))
    # a checkpoint round trip rebuilds the tables; the run goes on checking
    snap = json.loads(json.dumps(d.orch.snapshot()))
    d.orch = Checked.restore(sc["cfg"], snap)
    check_index(d.orch)
    d.run(sc["steps"] + 1)
    assert Checked.checks - before > sc["steps"]  # the check ran through the whole run


class _ForgetsTheSource(PoolIndex):
    """Mutant: a migration updates the tables of its destination, not of its source."""

    def vacate(self, src, sids=None):
        ss = src.samples
        if sids is None:
            ss.clear()
        else:
            ss.difference_update(sids)


class _Mutant(Checked):
    def __init__(self, config, instances):
        super().__init__(config, instances)
        fresh = _ForgetsTheSource(self.instances, self.samples, self.index.cap)
        fresh.__dict__.update(self.index.__dict__)
        self.index = fresh


def test_a_missed_update_is_caught():
    cfg = OrchestratorConfig(mode="dora", tbs=4, rbs=8, max_staleness=2, group_size=2, cap_before_rebalance=3,
                             cap_after_rebalance=2, rebalance_interval_s=1.0, kv_high_watermark=0.5)
    with pytest.raises(Inconsistent, match="index differs from the records"):
        for seed in range(40):  # one run with a migration suffices
            sc = dict(cfg=cfg, n_instances=4, seed=seed, fail_prob=0.05, join_prob=0.0, tail_alpha=1.1,
                      migration_fail_prob=0.0)
            _driver(sc, _Mutant).run(8)
