"""``dora train`` and ``dora simulate`` report their runs through one builder: the runtime's summary
(fake engines and trainer) and the simulator's hold the same recorder fields, in the same order,
counted from the same step records."""

from __future__ import annotations

import asyncio

from dora_megatron.observability.recorder import RUN_EXTRA_KEYS
from dora_megatron.observability.summary import SUMMARY_FIELDS, duplicated_groups


def _train_summary():
    from dora_megatron.controller.main import drive
    from tests.helpers.runtime import make

    rt, _engines, trainer = make(mode="dora")
    return rt, trainer, asyncio.run(drive(rt))


def _sim_summary():
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.engine import Simulation
    from tests.helpers.sim import FAST, TINY

    sim = Simulation(load_sim_config(str(TINY), FAST, mode="dora"))
    return sim, sim.run().summary


def test_train_and_simulate_summaries_share_the_builders_fields_and_step_records():
    rt, trainer, train = _train_summary()
    sim, simulated = _sim_summary()
    recorded = SUMMARY_FIELDS + RUN_EXTRA_KEYS
    n = len(recorded)
    assert tuple(train)[:n] == recorded and tuple(simulated)[:n] == recorded
    for driver, summary in ((rt.metrics, train), (sim.metrics, simulated)):
        rows = driver.rows  # the one step record, as both drivers fill it
        assert [r.step for r in rows] == list(range(summary["steps"]))
        assert all(len(r.groups) == summary["tbs"] and len(r.versions) == len(r.groups) for r in rows)
        assert sum(len(r.groups) for r in rows) == summary["consumed_groups"]
        assert summary["duplicated_groups"] == duplicated_groups(r.groups for r in rows) == 0
    assert [r.samples for r in rt.metrics.rows] == [len(batch) for batch in trainer.batches]


#: the summary fields the drivers count (``RunTotals``): the orchestrator's counters, and the KV
#: bytes the driver moved
COUNTED = ("dispatched_groups", "consumed_groups", "lost_groups", "c1_violations", "c3_violations", "migrations",
           "migrated_kv_bytes", "reprefill_tokens")


def test_train_and_simulate_count_every_shared_field_the_same_way():
    """The same orchestrator counts and the same moved KV bytes give the same summary fields through
    ``dora train``'s summary (``Runtime.summary``) and ``dora simulate``'s (``build_result``). The
    simulator's own checks and windowed counts are set to other numbers: they are its own fields
    (``extra``), never folded into a shared one."""
    from dora_megatron.sim.report import build_result

    rt, _trainer, _ = _train_summary()
    sim, _ = _sim_summary()
    lost, counts, moved = 4, {"c1_violations": 2, "c3_violations": 3, "migrations": 5, "reprefill_tokens": 7}, 1000
    for orch in (rt.orch, sim.orch):
        for key, value in counts.items():
            setattr(orch.counters, key, value)
        orch.audit = lambda: lost  # the groups the orchestrator's index says are lost
    rt.moves.migrated_bytes = moved
    sim.migrated_bytes = moved
    # what only the simulator sees, different from the orchestrator's counts
    sim.checks.lost, sim.checks.c3 = 8, 9
    sim.migrations_in_window, sim.sim_reprefill_tokens = 1, 11
    train = rt.summary(rt.metrics.rows[-1].end_s)
    res = build_result(sim, sim.q.now, 0.0)
    simulated = res.summary
    expected = {**counts, "lost_groups": lost, "migrated_kv_bytes": moved}
    assert {k: train[k] for k in expected} == expected
    assert {k: simulated[k] for k in expected} == expected
    for osum, summary in ((rt.orch.summary(), train), (sim.orch.summary(), simulated)):
        assert (summary["dispatched_groups"], summary["consumed_groups"]) == (osum["dispatched_groups"], osum["consumed_groups"])
    assert res.extra["sim_checks"] == {"lost_groups": 8, "c3_violations": 9}
    assert res.extra["migrations_in_window"] == 1 and res.extra["sim_reprefill_tokens"] == 11


def test_the_simulators_counted_fields_cover_the_whole_run_not_the_window():
    """A warm-up changes what the rates measure, never a count: the same run (one seed, decisions
    do not depend on the window) with 0 and 3 warm-up steps counts the same migrations and moved
    KV bytes, the warm-up's included; the window's moves are counted apart."""
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.engine import simulate
    from tests.helpers.sim import TINY

    runs = [simulate(load_sim_config(TINY, ["sim.steps=6", f"sim.warmup_steps={w}"], mode="dora")) for w in (0, 3)]
    (all_steps, warm) = runs
    for key in COUNTED:
        assert all_steps.summary[key] == warm.summary[key], key
    assert all_steps.summary["migrations"] > 0 and all_steps.summary["migrated_kv_bytes"] > 0
    assert 0 < warm.extra["migrations_in_window"] < warm.summary["migrations"]  # some moves were in the warm-up
