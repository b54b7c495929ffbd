"""The simulator's tiny config and the overrides that keep a test run short; shared by the sim tests."""

from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "configs" / "sim" / "tiny.yaml"
FAST = ["sim.steps=6", "sim.warmup_steps=1"]


def assert_run_invariants(sim, res, steps: int) -> None:
    """Exactly-once and exact TBS of a finished ``Simulation``: ``steps`` steps of TBS groups each,
    every consumed group dispatched, finished and consumed once, nothing lost or duplicated, the
    staleness bound kept, no deadlock (C1 too, except in partial mode, which breaks it)."""
    s = res.summary
    assert s["steps"] == steps and s["consumed_groups"] == steps * s["tbs"]
    assert s["lost_groups"] == 0 and s["duplicated_groups"] == 0
    assert_sim_checks_clean(res)
    consumed = [g for g in sim.groups.values() if g.consumed]
    assert len(consumed) == s["consumed_groups"]
    assert all(g.consumed == 1 and g.finished == len(g.sample_ids) for g in consumed)
    assert 0 <= s["dispatched_groups"] - s["consumed_groups"] <= s["rbs"]
    assert sum(s["staleness_histogram"].values()) == s["consumed_groups"]
    assert s["c3_violations"] == 0 and s["max_consumed_staleness"] <= s["max_staleness"]
    if s["mode"] != "partial":
        assert s["c1_violations"] == 0
    assert not res.extra["deadlock"]


def assert_sim_checks_clean(res) -> None:
    """The simulator's own check of every released batch (``extra["sim_checks"]``) found no lost
    group and no C3 violation: the summary's ``lost_groups`` / ``c3_violations`` are the
    orchestrator's counters (as in ``dora train``), so a test of them alone would not see a bug in
    those counters."""
    assert res.extra["sim_checks"] == {"lost_groups": 0, "c3_violations": 0}
