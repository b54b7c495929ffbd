"""The rebalance reads the pool through incremental counts (alive instances, busy serving
instances per version) so that the rebalance each finished sample triggers costs O(versions),
not O(instances). These tests run the optimized orchestrator next to a reference one that
derives the same inputs by scanning every instance (the straightforward definition, kept here),
on seeded random runs with failures, joins, failed migrations and a checkpoint round trip, and
require identical decisions (every action of every call) and identical pool views."""

import json

from hypothesis import HealthCheck, given, settings

from dora_megatron.orchestrator import Orchestrator

from .sim_driver import Driver
from tests.helpers.orchestrator_scenarios import scenarios


class Traced(Orchestrator):
    """Records every action list the orchestrator hands out."""

    def _fill(self):
        out = super()._fill()
        self.trace.append(out)
        return out

    @property
    def trace(self):
        if "_trace" not in self.__dict__:
            self._trace = []
        return self._trace


class ScansThePool(Traced):
    """Reference: the pool view by definition, from a scan of every instance record."""

    def _pool_view(self):
        alive = [i for i in self.instances.values() if i.alive]
        running = sorted(v for v, ids in self.index.active.items() if any(self.instances[i].samples for i in ids))
        idle = {v for v, ids in self.index.active.items() if any(not self.instances[i].samples for i in ids)}
        fast = super()._pool_view()
        assert fast == (len(alive), running, idle), (fast, (len(alive), running, idle))
        return len(alive), running, idle


def _driver(sc, cls):
    d = Driver(sc["cfg"], sc["n_instances"], sc["seed"], fail_prob=sc["fail_prob"], join_prob=sc["join_prob"],
               tail_alpha=sc["tail_alpha"], migration_fail_prob=sc["migration_fail_prob"])
    d.orch = cls(sc["cfg"], list(d.engines))
    return d


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(modes=("dora", "partial")))
def test_incremental_pool_view_decides_as_the_full_scan(sc):
    fast, ref = _driver(sc, Traced), _driver(sc, ScansThePool)
    fast.run(sc["steps"])
    ref.run(sc["steps"])
    assert fast.orch.trace == ref.orch.trace
    assert fast.batches == ref.batches
    assert fast.orch.summary() == ref.orch.summary()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(modes=("dora",)))
def test_restored_counts_match_the_scan(sc):
    """A checkpoint carries no counts: restore rebuilds them, and the run goes on deciding as the
    reference does (its scan is checked at every rebalance)."""
    d = _driver(sc, Traced)
    d.run(max(1, sc["steps"] // 2))
    snap = json.loads(json.dumps(d.orch.snapshot()))
    ref = ScansThePool.restore(sc["cfg"], snap)
    assert ref._pool_view() == Orchestrator.restore(sc["cfg"], snap)._pool_view()
    d.orch = ref
    d.run(sc["steps"] + 1)  # raises on a contract violation; the scan asserts on every rebalance


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(modes=("dora", "partial")))
def test_snapshot_records_equal_dataclasses_asdict(sc):
    """The snapshot reads the records' fields directly instead of ``dataclasses.asdict`` (its cost
    sits in one loop turn); the reference is asdict itself, and the snapshot owns its containers."""
    import dataclasses

    d = _driver(sc, Traced)
    d.run(max(1, sc["steps"] // 2))
    o = d.orch
    snap = o.snapshot()
    assert snap["groups"] == [dataclasses.asdict(g) for g in o.groups.values()]
    assert snap["samples"] == [dataclasses.asdict(s) for s in o.samples.values()]
    assert snap["instances"] == [{**dataclasses.asdict(i), "samples": sorted(i.samples)}
                                 for i in o.instances.values()]
    for gd, g in zip(snap["groups"], o.groups.values()):
        assert gd["sample_ids"] is not g.sample_ids
