"""Timeline of a run: which version each instance held when, requests, trainer phases.

Recorded as plain intervals while the run goes, exported twice: a Chrome trace
JSON (opens in Perfetto / chrome://tracing, one track per instance plus the
trainer) and a PNG (:mod:`.timeline_plot`: a few steps in detail, the whole run
by version age) for the docs and quick looks. No clock of its own: callers pass times in seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dora_megatron.observability.timeline_plot import UNVERSIONED_COLOR, concurrency  # noqa: F401 - re-exported


@dataclass
class Interval:
    track: str
    name: str
    start: float
    end: float
    version: int | None = None
    args: dict = field(default_factory=dict)


class Timeline:
    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self._open_versions: dict[str, tuple[int, float]] = {}

    # ---- recording -------------------------------------------------------
    def set_version(self, track: str, version: int, now: float) -> None:
        """``track`` holds ``version`` from ``now`` on (closes the previous span)."""
        prev = self._open_versions.get(track)
        if prev is not None:
            if prev[0] == version:
                return
            self.intervals.append(Interval(track, f"v{prev[0]}", prev[1], now, prev[0], {"kind": "version"}))
        self._open_versions[track] = (version, now)

    def span(self, track: str, name: str, start: float, end: float, version: int | None = None, **args) -> None:
        self.intervals.append(Interval(track, name, start, max(end, start), version, dict(args)))

    def close(self, now: float) -> None:
        for track, (version, start) in list(self._open_versions.items()):
            self.intervals.append(Interval(track, f"v{version}", start, now, version, {"kind": "version"}))
        self._open_versions.clear()

    # ---- export ----------------------------------------------------------
    def to_chrome_trace(self) -> dict:
        tracks = sorted({iv.track for iv in self.intervals})
        tid = {t: i for i, t in enumerate(tracks)}
        events: list[dict] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[t], "args": {"name": t}} for t in tracks
        ]
        for iv in self.intervals:
            args = dict(iv.args)
            if iv.version is not None:
                args["version"] = iv.version
            events.append({
                "name": iv.name, "cat": args.get("kind", "span"), "ph": "X", "pid": 1, "tid": tid[iv.track],
                "ts": round(iv.start * 1e6, 3), "dur": round((iv.end - iv.start) * 1e6, 3), "args": args,
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome_trace()))
        return path

    @classmethod
    def from_chrome_trace(cls, trace: dict) -> "Timeline":
        """The intervals of a :meth:`to_chrome_trace` dict (a ``trace.json`` read back), to draw a
        recorded run again (:meth:`write_png`)."""
        names = {e["tid"]: e["args"]["name"] for e in trace.get("traceEvents", ()) if e.get("ph") == "M"}
        tl = cls()
        for e in trace.get("traceEvents", ()):
            if e.get("ph") != "X":
                continue
            args = dict(e.get("args") or {})
            version = args.pop("version", None)
            start = float(e["ts"]) / 1e6
            tl.intervals.append(Interval(names.get(e["tid"], str(e["tid"])), e["name"], start,
                                         start + float(e["dur"]) / 1e6, version, args))
        return tl

    @classmethod
    def read_chrome_trace(cls, path: str | Path) -> "Timeline":
        return cls.from_chrome_trace(json.loads(Path(path).read_text()))

    def write_png(self, path: str | Path, title: str = "", *, window_steps: int = 6, warmup_steps: int = 0) -> Path:
        """``timeline.png``: a window of ``window_steps`` steady-state steps in detail above the
        whole run by version age (:func:`~dora_megatron.observability.timeline_plot.draw_timeline`)."""
        from dora_megatron.observability.timeline_plot import draw_timeline

        return draw_timeline(self.intervals, path, window_steps=window_steps, warmup_steps=warmup_steps, title=title)


#: version colours: matplotlib's tab10 without its grey, which is kept for spans of no version
#: (checkpoints), so that no version looks like a checkpoint bar
VERSION_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")


def version_color(version: int) -> str:
    return VERSION_COLORS[version % len(VERSION_COLORS)]
