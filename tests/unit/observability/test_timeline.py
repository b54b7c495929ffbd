"""Timeline recording and both exports."""

from __future__ import annotations

import json

from dora_megatron.controller.main import drive
from dora_megatron.observability.timeline import Timeline


def test_version_spans_and_chrome_trace(tmp_path):
    tl = Timeline()
    tl.set_version("engine0", 0, 0.0)
    tl.set_version("engine1", 0, 0.0)
    tl.set_version("engine0", 0, 1.0)  # no change: no new span
    tl.set_version("engine0", 1, 2.0)
    tl.span("trainer", "step 0", 1.0, 2.0, version=0, kind="train")
    tl.span("engine1", "req s1", 0.5, 3.0, version=0, kind="request")
    tl.close(4.0)
    versions = sorted((iv.track, iv.version, iv.start, iv.end) for iv in tl.intervals if iv.args.get("kind") == "version")
    assert versions == [("engine0", 0, 0.0, 2.0), ("engine0", 1, 2.0, 4.0), ("engine1", 0, 0.0, 4.0)]
    out = tl.write_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(out.read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5
    step = next(e for e in xs if e["name"] == "step 0")
    assert step["ts"] == 1e6 and step["dur"] == 1e6 and step["args"]["version"] == 0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"engine0", "engine1", "trainer"}


def test_png_written(tmp_path):
    tl = Timeline()
    tl.set_version("engine0", 0, 0.0)
    tl.set_version("engine0", 1, 1.0)
    tl.span("trainer", "step 0", 0.2, 1.0, version=0, kind="train")
    tl.close(2.0)
    png = tl.write_png(tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_curve():
    from dora_megatron.observability.timeline import Interval, concurrency

    ivs = [Interval("e", "a", 0.0, 2.0), Interval("e", "b", 1.0, 3.0), Interval("e", "c", 2.5, 4.0)]
    pts = concurrency(ivs)
    assert max(c for _, c in pts) == 2
    assert pts[-1] == (4.0, 0)
    # at t=2.0 one interval ends: count drops to 1 before c starts at 2.5
    assert dict(pts)[2.0] == 1 and dict(pts)[2.5] == 2


def test_no_version_is_drawn_in_the_grey_of_checkpoint_bars():
    from matplotlib.colors import to_rgb

    from dora_megatron.observability.timeline import UNVERSIONED_COLOR, version_color

    for v in range(40):
        r, g, b = to_rgb(version_color(v))
        assert max(r, g, b) - min(r, g, b) > 0.15, (v, version_color(v))  # a hue, not a grey
    assert len({version_color(v) for v in range(9)}) == 9
    r, g, b = to_rgb(UNVERSIONED_COLOR)
    assert r == g == b


def test_resumed_run_does_not_draw_the_time_before_the_crash_as_idle_instances(tmp_path):
    import asyncio

    from tests.helpers.runtime import make, resume

    rt, _, _ = make(mode="dora", steps=2, tmp_path=tmp_path)
    asyncio.run(drive(rt))
    rt2, _, trainer2 = make(mode="dora", steps=4, tmp_path=tmp_path, resume_from=2, timeline=Timeline())
    state = resume(rt2, trainer2, tmp_path, 2)
    asyncio.run(drive(rt2))
    offset = float(state["wall_s"])
    assert offset > 0
    versions = [iv for iv in rt2.timeline.intervals if iv.args.get("kind") == "version"]
    assert versions and min(iv.start for iv in versions) >= offset
    before = [iv for iv in rt2.timeline.intervals if iv.args.get("kind") == "resumed"]
    assert len(before) == 1 and before[0].start == 0.0 and offset <= before[0].end < offset + 5.0
    rt2.timeline.write_png(tmp_path / "timeline.png")
