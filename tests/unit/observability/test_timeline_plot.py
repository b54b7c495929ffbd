"""timeline.png: the detail window's selection, the version ages of the whole-run panel, and the
drawing of a recorded trace."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.controller.main import drive
from dora_megatron.observability.timeline import Interval, Timeline
from dora_megatron.observability.timeline_plot import (
    StepSpan, TrainerVersion, age_image, select_window, trainer_steps, window_times,
)
from tests.helpers.runtime import make

ROOT = Path(__file__).resolve().parents[3]

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_window_is_the_middle_of_the_steady_state():
    assert select_window(30, 6) == (12, 18)  # steps 1..29 are steady (step 0 waits for a whole rollout)
    lo, hi = select_window(31, 5)
    assert hi - lo == 5 and abs((lo - 1) - (31 - hi)) <= 1  # as many steady steps before as after
    assert select_window(30, 6, warmup_steps=10) == (17, 23)  # the middle of steps 10..29
    assert select_window(200, 1) == (100, 101)


def test_a_window_larger_than_the_run_draws_every_step_and_stays_inside_it():
    assert select_window(4, 6) == (0, 4)
    assert select_window(6, 6) == (0, 6)
    assert select_window(0, 6) == (0, 0)
    assert select_window(7, 6) == (1, 7)  # one step more than the window: the first step is left out
    assert select_window(10, 4, warmup_steps=50) == (6, 10)  # a warm-up longer than the run: the last steps


def test_the_window_key_is_bounded_at_one_step():
    from dora_megatron.config.schema import load_config

    with pytest.raises(ValueError, match=r"observability.timeline_window_steps: 0"):
        select_window(10, 0)
    with pytest.raises(ConfigError, match=r"observability.timeline_window_steps: must be >= 1, got 0"):
        load_config(ROOT / "configs" / "cpu_tiny.yaml", ["observability.timeline_window_steps=0"])
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", ["observability.timeline_window_steps=3"])
    assert cfg.observability.timeline_window_steps == 3


def test_window_times_start_where_the_trainer_starts_waiting_for_the_first_step():
    steps = [StepSpan(k, k + 0.5, k + 1.0, k + 1) for k in range(5)]
    assert window_times(steps, 1, 3, 9.0) == (1.0, 3.0)
    assert window_times(steps, 0, 2, 9.0) == (0.0, 2.0)
    assert window_times([], 0, 0, 9.0) == (0.0, 9.0)
    tv = TrainerVersion(steps)
    assert (tv.at(0.9), tv.at(1.0), tv.at(1.0, before=True), tv.at(99)) == (0, 1, 0, 5)


def test_age_is_the_trainer_version_minus_the_held_one_the_oldest_in_each_pixel():
    steps = [StepSpan(k, k + 0.5, k + 1.0, k + 1) for k in range(3)]  # v1 at 1 s, v2 at 2 s, v3 at 3 s
    spans = [Interval("e0", "v0", 0.0, 4.0, 0, {"kind": "version"}),
             Interval("e1", "v0", 0.0, 1.5, 0, {"kind": "version"}),
             Interval("e1", "v2", 1.5, 4.0, 2, {"kind": "version"})]
    img = age_image(["e0", "e1", "e2"], spans, steps, 0.0, 4.0, bins=4)
    assert img[0].tolist() == [0, 1, 2, 3]  # e0 never switches: it ages one version a step
    assert img[1].tolist() == [0, 1, 0, 1]  # pixel 1: v0 until 1.5 s (age 1) then v2 (age 0): the oldest
    assert all(math.isnan(x) for x in img[2])  # e2 held nothing


def _recorded(tmp_path, steps=3):
    rt, _, _ = make(mode="dora", steps=steps, timeline=Timeline())
    asyncio.run(drive(rt))
    return rt.timeline.write_chrome_trace(tmp_path / "trace.json")


def test_a_recorded_trace_reads_back_and_draws_both_panels(tmp_path):
    trace = _recorded(tmp_path)
    tl = Timeline.read_chrome_trace(trace)
    steps = trainer_steps(tl.intervals)
    assert [(s.step, s.version) for s in steps] == [(k, k + 1) for k in range(3)]  # the produced version
    kinds = {iv.args.get("kind") for iv in tl.intervals}
    assert {"version", "request", "train", "weight_sync"} <= kinds
    png = tl.write_png(tmp_path / "timeline.png", title="dora", window_steps=2)
    assert png.read_bytes()[:8] == PNG


def test_a_long_run_draws_in_seconds(tmp_path):
    """The whole-run panel is an image of fixed width: 3,000 steps on 4 instances."""
    tl = Timeline()
    for k in range(3000):
        tl.span("trainer", f"step {k}", 2.0 * k + 1.0, 2.0 * k + 2.0, version=k, kind="train", produced=k + 1)
        for i in range(4):
            tl.set_version(f"engine{i}", k - (i + k) % 3 if k >= 3 else 0, 2.0 * k + 0.1 * i)
    tl.close(6000.0)
    tl.write_png(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG


def test_the_simulators_segments_become_the_intervals_dora_train_records():
    from dora_megatron.sim.plots import timeline_intervals

    segments = [("r0", 0.0, 1.0, 0, "busy"), ("r0", 1.0, 1.5, 0, "idle"), ("r0", 1.5, 2.0, 0, "switching"),
                ("r0", 2.0, 4.0, 1, "busy"), ("r1", 0.0, 4.0, 0, "busy")]
    rows = [{"step": 0, "perf/step_time_s": 1.5, "perf/train_time_s": 0.5},
            {"step": 1, "perf/step_time_s": 2.0, "perf/train_time_s": 1.0}]
    ivs = timeline_intervals(segments, rows)
    versions = sorted((iv.track, iv.start, iv.end, iv.version) for iv in ivs if iv.args["kind"] == "version")
    assert versions == [("r0", 0.0, 2.0, 0), ("r0", 2.0, 4.0, 1), ("r1", 0.0, 4.0, 0)]  # busy + idle: one span
    assert [(iv.start, iv.end) for iv in ivs if iv.args["kind"] == "weight_sync"] == [(1.5, 2.0)]
    assert [(s.step, s.start, s.end, s.version) for s in trainer_steps(ivs)] == [(0, 1.0, 1.5, 1), (1, 2.5, 3.5, 2)]
