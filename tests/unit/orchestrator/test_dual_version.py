"""``orchestrator.dual_version``: an instance that still runs an older version's requests is switched
to the newest version when nothing else can serve it, and finishes those requests (its tail) on the
old weights. Hand-made states: the switch rule, where new work goes, C1 per trajectory, failure,
the snapshot; and a seeded run of the independent driver (tests/unit/orchestrator/sim_driver.py)."""

import json

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.config.schema import load_config
from dora_megatron.orchestrator import Orchestrator, Submit, SwitchVersion

from .sim_driver import Driver


def _cfg(dual: bool) -> OrchestratorConfig:
    return OrchestratorConfig(mode="dora", tbs=1, rbs=8, group_size=1, max_staleness=3, cap_before_rebalance=8,
                              cap_after_rebalance=8, rebalance_interval_s=0, dual_version=dual)


def _two_old_versions(dual: bool):
    """Instance a serves v1 (one request, g4.0), b serves v0 (g2.0, g3.0), and step 1 ends: the
    newest version v2 has admissible groups and both instances hold different older versions."""
    o = Orchestrator(_cfg(dual), ["a", "b"])
    o.start()
    o.on_sample_finished("g0.0")
    o.on_step_finished(1)  # consolidates v0 on b, switches a to v1
    o.on_switch_done("a", 1)
    o.on_sample_finished("g1.0")
    assert {k: sorted(i.samples) for k, i in o.instances.items()} == {"a": ["g4.0"], "b": ["g2.0", "g3.0"]}
    return o, o.on_step_finished(2)


def test_without_dual_version_the_newest_waits():
    o, acts = _two_old_versions(dual=False)
    assert not [a for a in acts if isinstance(a, SwitchVersion)]
    assert o.instances_by_version() == {0: 1, 1: 1}
    assert o.summary()["dual_switches"] == 0


def test_the_shortest_tail_switches_to_the_newest_and_keeps_its_version():
    o, acts = _two_old_versions(dual=True)
    assert [a for a in acts if isinstance(a, SwitchVersion)] == [SwitchVersion("a", 2, keep=1)]
    a = o.instances["a"]
    assert (a.target, a.tail_version, a.tail_left, sorted(a.samples)) == (2, 1, 1, ["g4.0"])
    assert o.summary()["dual_switches"] == 1
    acts = o.on_switch_done("a", 2)
    new = [x for x in acts if isinstance(x, Submit)]
    assert new and all(x.instance == "a" and x.version == 2 for x in new)  # v2 runs beside the tail
    assert "g4.0" in o.instances["a"].samples and o.sample_status("g4.0")["version"] == 1
    o.on_sample_finished("g4.0")
    assert (o.instances["a"].tail_version, o.instances["a"].tail_left) == (None, 0)  # weights dropped
    assert o.instances["a"].version == 2


def test_a_tail_takes_no_new_work_of_its_version():
    """A trajectory of the tail's version whose turn ended comes back as new work of v1: it is not
    placed on the instance that keeps v1's weights only for its tail."""
    o, _ = _two_old_versions(dual=True)
    o.on_switch_done("a", 2)
    o.on_turn_ended("g4.0")
    assert o.instances["a"].tail_version is None
    acts = o.on_turn_ready("g4.0")
    assert not [x for x in acts if isinstance(x, Submit) and x.sample_id == "g4.0"]
    assert o.sample_status("g4.0")["state"] == "pending"


def test_tail_samples_release_without_c1_violation():
    o, _ = _two_old_versions(dual=True)
    o.on_switch_done("a", 2)
    released = []
    for sid in ("g2.0", "g3.0", "g4.0"):
        released += [x for x in o.on_sample_finished(sid) if type(x).__name__ == "ReleaseBatch"]
    assert released and o.summary()["c1_violations"] == 0


def test_failure_of_an_instance_with_a_tail_requeues_by_version():
    o, _ = _two_old_versions(dual=True)
    o.on_switch_done("a", 2)
    v2 = [s for s in o.instances["a"].samples if s != "g4.0"]
    o.on_instance_failed("a")
    assert o.sample_status("g4.0")["state"] == "pending" and o.sample_status("g4.0")["version"] == 1
    assert all(o.sample_status(s)["version"] == 2 for s in v2)
    assert o.audit() == 0


def test_snapshot_round_trip_with_a_tail():
    o, _ = _two_old_versions(dual=True)
    snap = json.loads(json.dumps(o.snapshot()))
    clone = Orchestrator.restore(_cfg(True), snap)
    assert json.loads(json.dumps(clone.snapshot())) == snap
    assert clone.on_switch_done("a", 2) == o.on_switch_done("a", 2)
    assert clone.on_sample_finished("g4.0") == o.on_sample_finished("g4.0")
    assert clone.instances["a"].tail_version is None and clone.index.unserved() == o.index.unserved()
    # the tail was served, not demand: a rebalance after the restore leaves b alone
    assert clone.on_tick(100.0) == o.on_tick(100.0)


def test_seeded_two_instance_run_uses_dual_switches_and_keeps_the_contract():
    """Two instances, S = 3, heavy tails: the driver's own ledger checks C1 (each request's tokens
    from one weight set), C2, C3 and that a dual switch keeps exactly the version the engine holds."""
    runs = {}
    for dual in (False, True):
        cfg = OrchestratorConfig(mode="dora", tbs=2, rbs=8, group_size=2, max_staleness=3, cap_before_rebalance=4,
                                 cap_after_rebalance=4, dual_version=dual)
        d = Driver(cfg, 2, seed=3, tail_alpha=1.1, train_time=3.0)
        d.run(12)
        runs[dual] = d
    assert runs[False].orch.summary()["dual_switches"] == 0
    assert runs[True].orch.summary()["dual_switches"] > 0
    assert runs[True].max_running_versions >= 2


def test_a_run_config_refuses_dual_version():
    """No engine keeps a second weight set yet: a job with the key on is refused, naming it."""
    with pytest.raises(ConfigError, match="orchestrator.dual_version"):
        load_config(None, ["orchestrator.dual_version=true"])
