"""The runtime's metrics against independent facts: the run's timeline (written by the runtime's own
timeline calls, not by the recorder) says when each instance loaded weights, when the trainer
broadcast them and when each step ended; the per-step and run metrics must agree with it. The
simulator reports the same keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dora_megatron.config.sim import load_sim_config
from dora_megatron.controller.main import drive
from dora_megatron.observability.recorder import RUN_EXTRA_KEYS
from dora_megatron.observability.summary import SUMMARY_FIELDS
from dora_megatron.observability.timeline import Timeline
from dora_megatron.sim.engine import simulate

from tests.helpers.fakes import FakeEngine, FakeTrainer
from tests.helpers.runtime import make

TINY_SIM = Path(__file__).resolve().parents[3] / "configs" / "sim" / "tiny.yaml"


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def scalars(self, step: int, values: dict) -> None:
        self.rows.append({"step": step, **values})


def _run(mode: str, transport: str = "disk", push_s: float = 0.0, steps: int = 5):
    engines = {f"e{i}": FakeEngine(f"e{i}", token_s=0.001) for i in range(3)}
    rt, _, _ = make(mode=mode, steps=steps, transport=transport, engines=engines,
                    trainer=FakeTrainer(engines=engines, push_s=push_s), timeline=Timeline())
    sink = _Rows()
    rt.metrics.sinks.append(sink)
    summary = asyncio.run(drive(rt))
    return rt, summary, sink.rows


def _step_ends(timeline: Timeline) -> list[float]:
    spans = [iv for iv in timeline.intervals if iv.track == "trainer" and iv.args.get("kind") == "train"]
    return [iv.end for iv in sorted(spans, key=lambda iv: iv.end)]


def _per_step(spans: list[tuple[float, float]], ends: list[float]) -> list[float]:
    """Seconds of ``spans`` inside each step's interval (previous step's end, this step's end]."""
    out, prev = [], 0.0
    for end in ends:
        out.append(sum(max(0.0, min(b, end) - max(a, prev)) for a, b in spans))
        prev = end
    return out


def _loads(timeline: Timeline) -> list[tuple[float, float]]:
    return [(iv.start, iv.end) for iv in timeline.intervals if iv.args.get("kind") == "weight_sync"]


def test_weight_sync_time_is_per_step_and_the_fractions_are_measured():
    rt, summary, rows = _run("dora")
    ends = _step_ends(rt.timeline)
    assert [r["step"] for r in rows] == list(range(5)) and len(ends) == 5
    loads = _loads(rt.timeline)
    expected = _per_step(loads, ends)
    assert sum(1 for x in expected if x > 0) >= 2, expected  # several steps had loads
    got = [r["perf/weight_sync_time_s"] for r in rows]
    assert got == pytest.approx(expected, abs=1e-3)
    # over the run: every instance in the pool from 0 to the last step's end (no failure here)
    instance_s = len(rt.engines) * ends[-1]
    assert summary["weight_sync_fraction"] == pytest.approx(sum(expected) / instance_s, rel=0.02)
    # dora moves instances between versions by rebalancing: measured, and part of the weight sync
    assert summary["rebalance_fraction"] is not None
    assert 0 < summary["rebalance_fraction"] <= summary["weight_sync_fraction"] + 1e-12


def test_sync_mode_has_no_rebalance_but_measures_weight_sync():
    rt, summary, rows = _run("sync", steps=4)
    assert summary["rebalance_fraction"] is None and all(r["perf/rebalance_time_s"] is None for r in rows)
    assert summary["weight_sync_fraction"] > 0
    assert [r["perf/weight_sync_time_s"] for r in rows] == pytest.approx(
        _per_step(_loads(rt.timeline), _step_ends(rt.timeline)), abs=1e-3)


def test_sync_s_is_the_trainer_broadcast_time_of_the_step():
    """``distributed`` transport: each step's sync_s is the trainer's broadcast time inside its
    interval (one broadcast serves several instances: counted once)."""
    rt, summary, rows = _run("dora", transport="distributed", push_s=0.02)
    pushes = [(iv.start, iv.end) for iv in rt.timeline.intervals if iv.args.get("kind") == "broadcast"]
    assert pushes, "no broadcast happened"
    expected = _per_step(pushes, _step_ends(rt.timeline))
    assert [s.sync_s for s in rt.metrics.rows] == pytest.approx(expected, abs=2e-3)
    assert sum(s.sync_s for s in rt.metrics.rows) >= 0.019  # each broadcast took 20 ms
    assert [r["perf/sync_time_s"] for r in rows] == [s.sync_s for s in rt.metrics.rows]
    assert summary["trainer_sync_fraction"] > 0


def test_runtime_and_simulator_report_the_same_metric_keys():
    _, summary, rows = _run("dora", steps=3)
    sim = simulate(load_sim_config(TINY_SIM, ["sim.steps=3", "sim.warmup_steps=0"], mode="dora"))
    wanted = set(SUMMARY_FIELDS) | set(RUN_EXTRA_KEYS)
    assert wanted <= set(summary) and wanted <= set(sim.summary)
    for key in ("weight_sync_fraction", "rebalance_fraction", "rollout_utilization"):
        assert summary[key] is not None and sim.summary[key] is not None, key
    train_keys = {k for k in rows[0] if not k.startswith("train/")}  # train/*: the trainer's own metrics
    assert [set(r) for r in sim.steps] == [train_keys] * 3
