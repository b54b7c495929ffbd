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
