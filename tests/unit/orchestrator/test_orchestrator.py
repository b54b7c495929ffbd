"""Hand-made states for each orchestrator step: modes, rebalancing, failures, caps, snapshots."""

import json

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import (Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion)


class Harness:
    """Records actions; knows where each sample runs and which switches are outstanding."""

    def __init__(self, instances=("a", "b"), **cfg):
        self.cfg = OrchestratorConfig(**cfg)
        self.o = Orchestrator(self.cfg, list(instances))
        self.log: list = []
        self.where: dict[str, str] = {}
        self.switching: dict[str, int] = {}
        self.batches: list[ReleaseBatch] = []
        self.do(self.o.start())

    def do(self, actions):
        for a in actions:
            self.log.append(a)
            if isinstance(a, Submit):
                self.where[a.sample_id] = a.instance
            elif isinstance(a, Migrate):
                assert self.where[a.sample_id] == a.src
                self.where[a.sample_id] = a.dst
            elif isinstance(a, Interrupt):
                del self.where[a.sample_id]
            elif isinstance(a, SwitchVersion):
                assert a.instance not in self.where.values()
                self.switching[a.instance] = a.version
            elif isinstance(a, ReleaseBatch):
                self.batches.append(a)
        return actions

    def finish(self, *sids):
        for sid in sids:
            self.where.pop(sid, None)
            self.do(self.o.on_sample_finished(sid))

    def switches_done(self):
        while self.switching:
            iid, v = self.switching.popitem()
            self.do(self.o.on_switch_done(iid, v))

    def of(self, kind):
        return [a for a in self.log if isinstance(a, kind)]


def test_config_check():
    with pytest.raises(ConfigError, match="rbs"):
        OrchestratorConfig(tbs=8, rbs=4).check("orchestrator")
    with pytest.raises(ConfigError, match="cap_after"):
        OrchestratorConfig(cap_before_rebalance=2, cap_after_rebalance=4).check("orchestrator")
    assert OrchestratorConfig(mode="sync", max_staleness=3).effective_staleness == 0
    assert OrchestratorConfig(mode="one_step_off", max_staleness=3).effective_staleness == 1
    assert OrchestratorConfig(mode="one_step_off", tbs=2, rbs=9).effective_rbs == 2


def test_sync_dispatches_one_batch_and_waits_for_all_instances():
    h = Harness(mode="sync", tbs=2, rbs=8, group_size=2)
    assert [d.version for d in h.of(Dispatch)] == [0, 0]
    assert len(h.of(Submit)) == 4
    h.finish("g0.0", "g0.1", "g1.0")
    assert h.batches == []
    h.finish("g1.1")
    assert h.batches[-1] == ReleaseBatch(0, ("g0", "g1"), (0, 0))
    assert len(h.of(Dispatch)) == 2  # nothing more while training (S = 0)
    h.do(h.o.on_step_finished(1))
    assert sorted(h.switching) == ["a", "b"] and set(h.switching.values()) == {1}
    h.do(h.o.on_switch_done("a", 1))
    h.switching.pop("a")
    assert len(h.of(Dispatch)) == 2  # barrier: b still switching
    h.switches_done()
    assert [d.version for d in h.of(Dispatch)] == [0, 0, 1, 1]


def test_one_step_off_dispatches_next_batch_with_old_weights_while_training():
    h = Harness(mode="one_step_off", tbs=1, rbs=5, group_size=1)
    assert [d.version for d in h.of(Dispatch)] == [0]
    h.finish("g0.0")
    assert h.batches[-1].group_ids == ("g0",)
    # trainer busy with step 0; batch for step 1 goes out at version 0 now
    assert [d.version for d in h.of(Dispatch)] == [0, 0]
    h.do(h.o.on_step_finished(1))
    # the instance running g1 drains before switching; the idle one switches at once
    busy = h.where["g1.0"]
    assert busy not in h.switching and len(h.switching) == 1
    h.switches_done()
    h.finish("g1.0")
    assert h.batches[-1] == ReleaseBatch(1, ("g1",), (0,))
    h.switches_done()
    assert [d.version for d in h.of(Dispatch)] == [0, 0, 1]


def test_partial_interrupts_records_min_max_version_and_counts_reprefill():
    h = Harness(instances=("a",), mode="partial", tbs=1, rbs=2, group_size=1, max_staleness=1,
                cap_before_rebalance=4, cap_after_rebalance=4)
    for d in h.of(Dispatch):
        h.o.set_prompt_tokens(d.group_id, 10)
    assert [d.version for d in h.of(Dispatch)] == [0, 0]
    h.finish("g0.0")
    assert h.batches[-1].group_ids == ("g0",)
    h.o.on_sample_progress("g1.0", 7)
    h.do(h.o.on_step_finished(1))
    assert Interrupt("g1.0", "a") in h.log and h.switching == {"a": 1}
    h.switches_done()
    resumed = [a for a in h.of(Submit) if a.sample_id == "g1.0"]
    assert resumed[-1] == Submit("g1.0", "a", 1, True)
    st = h.o.sample_status("g1.0")
    assert (st["min_version"], st["max_version"], st["version"]) == (0, 1, 1)
    assert h.o.summary()["reprefill_tokens"] == 10 + 7
    h.finish("g1.0")
    assert h.batches[-1].group_ids == ("g1",)
    assert h.o.summary()["c1_violations"] == 1


def test_versions_an_engine_reports_count_as_c1_at_release_and_are_ignored_once_consumed():
    """The driver reports what the engine said produced a sample's tokens; the orchestrator's
    counter is the only C1 count of a run (runtime and simulator summaries read it)."""
    h = Harness(instances=("a",), mode="dora", tbs=1, rbs=2, group_size=1, max_staleness=1,
                cap_before_rebalance=4, cap_after_rebalance=4)
    assert h.o.on_sample_versions("g0.0", [0]) == []  # the routed version only: C1 kept
    h.finish("g0.0")
    assert h.batches[-1].group_ids == ("g0",) and h.o.summary()["c1_violations"] == 0
    h.o.on_sample_versions("g0.0", [0, 3])  # consumed and forgotten: a late report changes nothing
    h.do(h.o.on_step_finished(1))
    h.switches_done()
    h.o.on_sample_versions("g1.0", [0, 1])  # an answer that crossed a weight update
    assert (h.o.sample_status("g1.0")["min_version"], h.o.sample_status("g1.0")["max_version"]) == (0, 1)
    h.finish("g1.0")
    assert h.batches[-1].group_ids == ("g1",) and h.o.summary()["c1_violations"] == 1


def test_is_alive_follows_failures_and_joins():
    h = Harness(instances=("a", "b"), mode="dora", tbs=1, rbs=2, group_size=1, max_staleness=1)
    assert h.o.is_alive("a") and not h.o.is_alive("zz")  # an unknown instance is not in the pool
    h.do(h.o.on_instance_failed("a"))
    assert not h.o.is_alive("a") and h.o.is_alive("b")
    h.do(h.o.on_instance_joined("a"))
    assert h.o.is_alive("a")


def test_fig6_long_tail_keeps_running_on_its_own_version():
    """Paper Fig. 6 with our numbering (w1 = version 0): trajectory 4 (g3) is a long-tail v0
    request; steps keep training, the next version starts on the other instance, and g3 finishes
    under v0 on its own instance, never migrated or interrupted, then joins a later batch."""
    h = Harness(mode="dora", tbs=3, rbs=4, group_size=1, max_staleness=2, cap_before_rebalance=4,
                cap_after_rebalance=4, rebalance_interval_s=0)
    assert h.where == {"g0.0": "a", "g1.0": "b", "g2.0": "a", "g3.0": "b"}
    h.finish("g0.0", "g2.0", "g1.0")
    assert h.batches[-1] == ReleaseBatch(0, ("g0", "g2", "g1"), (0, 0, 0))
    # trainer busy with step 0: the window still admits version 0 work up to RBS
    assert [d.version for d in h.of(Dispatch)] == [0] * 7
    h.finish("g4.0", "g5.0", "g6.0")
    h.do(h.o.on_step_finished(1))
    assert h.batches[-1] == ReleaseBatch(1, ("g4", "g5", "g6"), (0, 0, 0))  # step 1 proceeds without g3
    # rebalance: v0 keeps the instance of the long tail (b), a moves to version 1
    assert h.switching == {"a": 1}
    h.switches_done()
    new = [d for d in h.of(Dispatch) if d.version == 1]
    assert len(new) == 3 and all(h.where[d.sample_ids[0]] == "a" for d in new)
    for d in new:
        h.finish(d.sample_ids[0])
    h.do(h.o.on_step_finished(2))
    assert len(h.batches) == 2  # B_2 must contain g3 (version 2 - S): the trainer waits
    assert h.where["g3.0"] == "b" and h.o.sample_status("g3.0")["version"] == 0
    assert not any(getattr(a, "sample_id", None) == "g3.0" for a in h.of(Migrate) + h.of(Interrupt))
    h.finish("g3.0")
    assert h.batches[-1].step == 2 and h.batches[-1].group_ids[0] == "g3"
    assert h.o.summary()["max_consumed_staleness"] == 2
    assert h.o.summary()["c1_violations"] == 0
    # b drained: it is freed for the newest version
    assert h.switching.get("b") == 2 or h.o.instances["b"].version != 0


def test_rebalance_shrinks_least_loaded_and_migrates_only_its_requests():
    h = Harness(instances=("a", "b", "c", "d"), mode="dora", tbs=4, rbs=12, group_size=1, max_staleness=2,
                cap_before_rebalance=3, cap_after_rebalance=3, imbalance_ratio=100.0)
    assert len(h.where) == 12
    on = {i: sorted(s for s, x in h.where.items() if x == i) for i in "abcd"}
    h.finish(*on["a"][:3], *on["b"][:2])   # a idle, b: 1, c: 3, d: 3
    assert [b.step for b in h.batches] == [0]
    before = dict(h.where)
    h.do(h.o.on_step_finished(1))
    # demand v0 = 7, new v1 = 4 admissible -> quotas 2.55 / 1.45 -> {v0: 3, v1: 1}: a (idle) moves
    assert h.switching == {"a": 1}
    assert h.of(Migrate) == []
    h.switches_done()
    assert all(h.where[sid] == inst for sid, inst in before.items())
    assert h.o.instances_by_version() == {0: 3, 1: 1}


def test_migration_budget_frees_only_instances_whose_requests_fit():
    h = Harness(instances=("a", "b", "c", "d"), mode="dora", tbs=4, rbs=12, group_size=1, max_staleness=2,
                cap_before_rebalance=3, cap_after_rebalance=3, imbalance_ratio=1.0, max_migrations_per_rebalance=2)
    on = {i: sorted(s for s, x in h.where.items() if x == i) for i in "abcd"}
    h.finish(*on["a"][:2], *on["b"][:1], *on["c"][:1])   # a: 1, b: 2, c: 2, d: 3 running
    h.do(h.o.on_step_finished(1))
    moves = h.of(Migrate)
    assert len(moves) <= 2 and all(m.src == "a" for m in moves)
    assert set(h.switching) == {"a"}


def test_migration_plan_moves_requests_of_freed_instance_to_same_version_peer():
    h = Harness(instances=("a", "b", "c"), mode="dora", tbs=1, rbs=4, group_size=1, max_staleness=3,
                cap_before_rebalance=2, cap_after_rebalance=2, imbalance_ratio=1.0)
    # v0: 4 samples over 3 instances (a:2, b:1, c:1)
    counts = {i: sum(1 for x in h.where.values() if x == i) for i in "abc"}
    assert sorted(counts.values()) == [1, 1, 2]
    first = sorted(h.where)[0]
    h.finish(first)
    h.do(h.o.on_step_finished(1))
    h.switches_done()
    for m in h.of(Migrate):
        assert m.version == 0
        assert h.o.instances[m.dst].version == 0
        assert h.o.instances[m.src].version != 0 or h.o.instances[m.src].target is not None
    for sw in h.of(SwitchVersion):
        assert sw.version == 1


def test_failure_requeues_on_same_version_instance():
    h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=2, group_size=2, max_staleness=1,
                cap_before_rebalance=4, cap_after_rebalance=4)
    on_a = sorted(s for s, i in h.where.items() if i == "a")
    h.o.on_sample_progress(on_a[0], 5)
    acts = h.do(h.o.on_instance_failed("a"))
    subs = [a for a in acts if isinstance(a, Submit)]
    assert sorted(a.sample_id for a in subs) == on_a
    assert all(a.instance == "b" and a.version == 0 for a in subs)
    assert [a.resume for a in subs if a.sample_id == on_a[0]] == [True]
    assert h.o.audit() == 0


def test_failure_of_last_instance_of_a_version_switches_one_back():
    h = Harness(instances=("a", "b"), mode="one_step_off", tbs=1, rbs=1, group_size=1)
    h.finish("g0.0")
    h.do(h.o.on_step_finished(1))      # g1 (v0) runs; the idle instance switches to v1
    runner = h.where["g1.0"]
    other = "b" if runner == "a" else "a"
    h.switches_done()
    assert h.o.instances[other].version == 1
    acts = h.do(h.o.on_instance_failed(runner))
    assert SwitchVersion(other, 0) in acts       # back to v0 from its snapshot
    h.where.pop("g1.0")
    h.switches_done()
    assert h.where["g1.0"] == other and h.o.sample_status("g1.0")["version"] == 0
    h.finish("g1.0")
    assert h.batches[-1] == ReleaseBatch(1, ("g1",), (0,))


def test_dora_failure_with_no_instance_left_on_version():
    h = Harness(instances=("a", "b"), mode="dora", tbs=1, rbs=2, group_size=1, max_staleness=1,
                cap_before_rebalance=2, cap_after_rebalance=2, imbalance_ratio=100.0)
    assert h.where == {"g0.0": "a", "g1.0": "b"}
    h.finish("g0.0")
    h.do(h.o.on_step_finished(1))
    assert h.switching == {"a": 1}          # idle a takes the new version, g1 keeps b on v0
    h.switches_done()
    assert h.where["g2.0"] == "a" and h.o.sample_status("g2.0")["version"] == 1
    h.do(h.o.on_instance_failed("b"))        # the only v0 instance dies with g1 on it
    h.where.pop("g1.0")
    assert h.o.sample_status("g1.0")["state"] == "pending"
    assert h.batches[-1].step == 0            # B_1 must contain g1 (version 1 - S): waits
    h.finish("g2.0")                          # a drains -> switched back to v0 from its snapshot
    assert h.switching == {"a": 0}
    h.switches_done()
    assert h.where["g1.0"] == "a" and h.o.sample_status("g1.0")["version"] == 0
    h.finish("g1.0")
    assert h.batches[-1] == ReleaseBatch(1, ("g1",), (0,))
    assert h.o.audit() == 0


def test_failed_migration_requeues_the_request_on_its_version():
    h = Harness(instances=("a", "b", "c"), mode="dora", tbs=8, rbs=8, group_size=1, max_staleness=0,
                cap_before_rebalance=8, cap_after_rebalance=8, kv_high_watermark=0.8)
    on_a = sorted(s for s, i in h.where.items() if i == "a")
    h.finish(*[s for s, i in sorted(h.where.items()) if i != "a"])
    moves = [a for a in h.do(h.o.on_instance_stats("a", len(on_a), 0.95)) if isinstance(a, Migrate)]
    assert moves
    m = moves[0]
    acts = h.do(h.o.on_migration_failed(m.sample_id))
    sub = [a for a in acts if isinstance(a, Submit) and a.sample_id == m.sample_id]
    assert len(sub) == 1 and sub[0].version == 0 and h.o.instances[sub[0].instance].version == 0
    assert h.o.sample_status(m.sample_id)["state"] == "running" and h.o.audit() == 0
    assert h.o.on_migration_failed("nope") == []


def test_kv_watermark_levels_load_within_version():
    h = Harness(instances=("a", "b"), mode="dora", tbs=8, rbs=8, group_size=1, max_staleness=0,
                cap_before_rebalance=8, cap_after_rebalance=8, kv_high_watermark=0.8)
    on_b = sorted(s for s, i in h.where.items() if i == "b")
    h.finish(*on_b)  # a: 4 running, b: idle
    assert h.o.instances["a"].load == 4
    acts = h.do(h.o.on_instance_stats("a", 4, 0.95))
    moves = [a for a in acts if isinstance(a, Migrate)]
    assert len(moves) == 2 and all(m.src == "a" and m.dst == "b" for m in moves)


def test_two_phase_caps_and_timer_trigger():
    h = Harness(instances=("a",), mode="dora", tbs=4, rbs=16, group_size=1, max_staleness=3,
                cap_before_rebalance=6, cap_after_rebalance=2, rebalance_interval_s=10.0)
    assert h.o.cap() == 6 and len(h.where) == 6
    h.do(h.o.on_tick(5.0))
    assert h.o.cap() == 6
    # the timer fires the first load-balancing of the step: the low cap applies from now on
    h.do(h.o.on_tick(20.0))
    assert h.o.cap() == 2
    h.finish(*sorted(h.where)[:3])
    assert len(h.where) == 3                  # 6 - 3 finished, nothing new: over the cap of 2
    h.finish(*sorted(h.where)[:2])
    assert len(h.where) == 2                  # back under the cap: one new sample
    assert h.batches
    h.do(h.o.on_step_finished(1))
    assert h.o.cap() == 6                     # a new step starts in the high-cap phase


def test_legacy_fill_off_by_default_and_bounded_by_admission_when_on():
    extra = {}
    for fill in (False, True):
        h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=6, group_size=1, max_staleness=3,
                    cap_before_rebalance=2, cap_after_rebalance=2, legacy_fill=fill, imbalance_ratio=100.0)
        h.finish("g0.0", "g1.0")
        assert [d.version for d in h.of(Dispatch)] == [0] * 6
        h.do(h.o.on_step_finished(1))
        h.switches_done()
        assert h.o.instances_by_version() == {0: 1, 1: 1}
        mark = len(h.log)
        legacy = [i for i, inst in h.o.instances.items() if inst.version == 0][0]
        for sid in sorted(s for s, i in h.where.items() if i == legacy)[:3]:
            h.finish(sid)
        extra[fill] = [a for a in h.log[mark:] if isinstance(a, Dispatch) and a.version == 0]
        assert h.o.index.dispatched[0] <= (0 + 3 + 1) * 2
    assert extra[False] == []
    assert len(extra[True]) >= 1


def test_snapshot_is_json_and_restores():
    h = Harness(instances=("a", "b", "c"), mode="dora", tbs=2, rbs=5, group_size=2, max_staleness=1)
    h.finish(*sorted(h.where)[:4])
    snap = json.loads(json.dumps(h.o.snapshot()))
    clone = Orchestrator.restore(h.cfg, snap)
    assert clone.summary() == h.o.summary()
    assert clone.sample_status("g2.0") == h.o.sample_status("g2.0")
    assert clone.on_step_finished(1) == h.o.on_step_finished(1)


def test_step_finished_out_of_order_is_rejected():
    h = Harness(mode="dora", tbs=1, rbs=1, group_size=1)
    with pytest.raises(ValueError):
        h.o.on_step_finished(1)  # no batch released yet


def test_kv_trigger_runs_a_full_rebalance_at_most_once_per_interval():
    def run(gap):
        h = Harness(instances=("a", "b"), mode="dora", tbs=8, rbs=8, group_size=1, max_staleness=0,
                    cap_before_rebalance=8, cap_after_rebalance=8, kv_high_watermark=0.8,
                    rebalance_interval_s=0.0, kv_rebalance_min_interval_s=gap)
        seen = []
        for now in (5.0, 5.5, 5.9, 6.0, 6.2, 7.5):
            h.do(h.o.on_instance_stats("a", 4, 0.95, now=now))
            seen.append(h.o.snapshot()["last_rebalance"])
        return seen

    assert run(1.0) == [5.0, 5.0, 5.0, 6.0, 6.0, 7.5]
    assert run(0.0) == [5.0, 5.5, 5.9, 6.0, 6.2, 7.5]  # 0 = every report above the watermark


def test_kv_rate_limited_report_still_levels_the_hot_instance():
    h = Harness(instances=("a", "b"), mode="dora", tbs=8, rbs=8, group_size=1, max_staleness=0,
                cap_before_rebalance=8, cap_after_rebalance=8, kv_high_watermark=0.8,
                rebalance_interval_s=0.0, kv_rebalance_min_interval_s=100.0)
    h.do(h.o.on_instance_stats("b", 4, 0.95, now=1.0))  # uses up the interval
    on_b = sorted(s for s, i in h.where.items() if i == "b")
    h.finish(*on_b)
    acts = h.do(h.o.on_instance_stats("a", 4, 0.95, now=2.0))
    assert h.o.snapshot()["last_rebalance"] != 2.0
    moves = [a for a in acts if isinstance(a, Migrate)]
    assert len(moves) == 2 and all(m.src == "a" and m.dst == "b" for m in moves)


def test_new_instance_of_a_version_takes_the_requests_held_above_the_cap():
    h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=4, group_size=2, max_staleness=1,
                cap_before_rebalance=4, cap_after_rebalance=2, rebalance_interval_s=5.0)
    assert h.o.instances["a"].load == 4 and h.o.instances["b"].load == 4
    h.do(h.o.on_tick(10.0))  # first load-balancing of the step: cap drops to 2, both are over it
    assert h.o.cap() == 2 and not h.of(Migrate)
    h.do(h.o.on_instance_joined("c"))
    acts = h.do(h.o.on_switch_done("c", 0))
    moves = [a for a in acts if isinstance(a, Migrate)]
    assert len(moves) == 2 and all(m.dst == "c" and m.version == 0 for m in moves)
    loads = {i: h.o.instances[i].load for i in "abc"}
    assert loads["c"] == 2 and sum(loads.values()) == 8 and min(loads["a"], loads["b"]) >= 2
    assert h.o.audit() == 0
    # a further instance takes the rest of the excess, and no instance is left over the cap
    h.do(h.o.on_instance_joined("d"))
    h.do(h.o.on_switch_done("d", 0))
    assert all(h.o.instances[i].load <= 2 for i in "abcd")


def test_new_instance_takes_nothing_when_no_peer_is_over_the_cap():
    h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=4, group_size=2, max_staleness=1,
                cap_before_rebalance=4, cap_after_rebalance=4)
    h.do(h.o.on_instance_joined("c"))
    acts = h.do(h.o.on_switch_done("c", 0))
    assert not [a for a in acts if isinstance(a, Migrate)]


def test_release_is_not_reevaluated_without_a_completed_group_or_a_new_step(monkeypatch):
    """The orchestrator looks for a formable batch (``select_batch``) only after a group completed
    or a step ended: ticks and unfinished samples do not pay for the search again."""
    from dora_megatron.orchestrator import core
    from dora_megatron.orchestrator.rules import select_batch

    searches = []

    def counted(*args):
        searches.append(args[0])
        return select_batch(*args)

    monkeypatch.setattr(core, "select_batch", counted)
    h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=4, group_size=2, max_staleness=1)
    gid = sorted(h.where)[0].rsplit(".", 1)[0]
    before = len(searches)
    h.finish(f"{gid}.0")               # half a group: nothing completed, no search
    assert len(searches) == before
    h.finish(f"{gid}.1")               # one complete group: one search, not enough for TBS=2
    assert not h.batches and len(searches) == before + 1
    for now in (1.0, 2.0, 3.0):
        h.do(h.o.on_tick(now))
    assert not h.batches and len(searches) == before + 1  # ticks did not search again
    rest = sorted(s for s in h.where if not s.startswith(gid + "."))
    h.finish(rest[0])                  # a sample, not a group: no search
    assert len(searches) == before + 1
    h.finish(rest[1])
    assert len(h.batches) == 1 and len(h.batches[0].group_ids) == 2
    assert len(searches) == before + 2
    h.do(h.o.on_step_finished(1))      # a step ended: the next step's batch is looked for once
    assert searches[before + 2:] == [h.o.next_step]


def test_consumed_groups_are_forgotten_and_late_reports_are_harmless():
    """A released group leaves the orchestrator's state and snapshot (its record is the
    ReleaseBatch, logged by the driver), so state is O(outstanding work), not O(history)."""
    h = Harness(instances=("a", "b"), mode="dora", tbs=2, rbs=4, group_size=2, max_staleness=1)
    dispatched = {sid for a in h.of(Dispatch) for sid in a.sample_ids}
    h.finish(*sorted(h.where)[:4])
    (batch,) = h.batches
    gone = {f"{g}.{i}" for g in batch.group_ids for i in range(2)}
    assert gone <= dispatched
    snap = json.loads(json.dumps(h.o.snapshot()))
    assert not {g["group_id"] for g in snap["groups"]} & set(batch.group_ids)
    assert not {s["sample_id"] for s in snap["samples"]} & gone
    assert len(snap["samples"]) == 2 * h.o.outstanding
    with pytest.raises(KeyError, match="consumed"):
        h.o.sample_status(sorted(gone)[0])
    ignored = h.o.counters.ignored_events
    assert h.o.on_sample_finished(sorted(gone)[0]) == []  # a late duplicate report
    assert h.o.counters.ignored_events == ignored + 1
    h.o.set_prompt_tokens(batch.group_ids[0], 10)  # late: ignored, no KeyError
    s = h.o.summary()
    assert s["consumed_groups"] == 2 and s["lost_groups"] == 0 and s["duplicate_releases"] == 0
    clone = Orchestrator.restore(h.cfg, snap)
    assert clone.summary() == s
    assert clone.on_step_finished(1) == h.o.on_step_finished(1)


def test_a_snapshot_of_another_format_is_refused_naming_it():
    """Only this version's snapshot format is read: another is refused, naming its format."""
    h = Harness(mode="dora")
    snap = json.loads(json.dumps(h.o.snapshot()))
    assert Orchestrator.restore(h.cfg, snap).summary() == h.o.summary()
    for fmt in (1, 2, 99):  # 2: the counter duplicate_releases was named duplicated_groups
        with pytest.raises(ValueError, match=f"format {fmt} is not supported"):
            Orchestrator.restore(h.cfg, {**snap, "format": fmt})


def _two_busy_instances(free_into_room):
    """a and b on v0 with 4 requests each at the cap of 4, then weights v1 arrive."""
    h = Harness(instances=("a", "b"), mode="dora", tbs=4, rbs=12, group_size=1, max_staleness=2,
                cap_before_rebalance=4, cap_after_rebalance=4, free_into_room=free_into_room)
    for _ in range(2):
        for i in "ab":
            h.finish(sorted(s for s, x in h.where.items() if x == i)[0])
    assert [b.step for b in h.batches] == [0]
    assert sorted(list(h.where.values()).count(i) for i in "ab") == [4, 4]
    h.do(h.o.on_step_finished(1))
    return h


def _max_load_after_moves(h):
    load = {i: list(h.where.values()).count(i) for i in "ab"}
    return max(load[m.dst] for m in h.of(Migrate)) if h.of(Migrate) else 0


def test_rebalance_frees_an_instance_only_when_its_requests_fit_under_the_cap_of_the_kept_one():
    """With ``free_into_room`` a new version gets the instance once the old version's requests fit on
    the other one, instead of at once with half of them queued above the cap there."""
    h = _two_busy_instances(free_into_room=False)
    assert h.switching and len(h.of(Migrate)) == 4 and _max_load_after_moves(h) == 8  # above the cap of 4

    h = _two_busy_instances(free_into_room=True)
    assert h.of(Migrate) == [] and h.switching == {}
    for i in "ab":  # 3 + 3: three do not fit in the one free slot of the other
        h.finish(sorted(s for s, x in h.where.items() if x == i)[0])
    assert h.of(Migrate) == [] and h.switching == {}
    h.finish(sorted(s for s, x in h.where.items() if x == "a")[0])  # a: 2, b: 3 -> a's 2 do not fit in 1
    assert h.of(Migrate) == [] and h.switching == {}
    h.finish(sorted(s for s, x in h.where.items() if x == "b")[0])  # 2 + 2: they fit
    assert list(h.switching.values()) == [1] and len(h.of(Migrate)) == 2
    assert _max_load_after_moves(h) == 4
    h.switches_done()
    assert h.o.instances_by_version() == {0: 1, 1: 1}


def test_free_into_room_frees_least_loaded_first_and_counts_the_room_of_those_that_stay():
    from dora_megatron.orchestrator.plan import free_into_room

    loads = {"a": 1, "b": 3, "c": 4, "d": 2}
    assert free_into_room(["b", "a"], loads, 4) == ["a"]  # room: c 0 + d 2; a (1) fits, b (3) then does not
    assert free_into_room(["b", "a"], loads, 5) == ["b", "a"]  # room 1 + 3 = 4 >= 1 + 3
    # p does not fit in k's one free slot and stays; its two free slots then take q's requests
    assert free_into_room(["p", "q"], {"k": 3, "p": 2, "q": 2}, 4) == ["q"]
    assert free_into_room(["c"], {"c": 4, "f": 4}, 4) == []  # the kept one is full
