"""Timeline of a run: which version each instance held when, requests, trainer phases.

Recorded as plain intervals while the run goes, exported twice: a Chrome trace
JSON (opens in Perfetto / chrome://tracing, one track per instance plus the
trainer) and a PNG (instance x time, coloured by version) for the README and
quick looks. No clock of its own: callers pass times in seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


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

    def write_png(self, path: str | Path, title: str = "instances x time, coloured by version (line: running requests)") -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        version_spans = [iv for iv in self.intervals if iv.args.get("kind") == "version"]
        other = [iv for iv in self.intervals if iv.args.get("kind") != "version"]
        tracks = sorted({iv.track for iv in self.intervals}, key=_track_key)
        row = {t: i for i, t in enumerate(tracks)}
        fig, ax = plt.subplots(figsize=(10, 0.45 * max(len(tracks), 2) + 1.5))
        seen_versions: set[int] = set()
        for iv in version_spans:
            v = iv.version or 0
            label = f"v{v}" if v not in seen_versions else None
            seen_versions.add(v)
            ax.broken_barh([(iv.start, iv.end - iv.start)], (row[iv.track] - 0.4, 0.8),
                           facecolors=version_color(v), alpha=0.55, label=label)
        requests: dict[str, list[Interval]] = {}
        for iv in other:
            if iv.args.get("kind") == "request":
                requests.setdefault(iv.track, []).append(iv)
                continue
            if iv.args.get("kind") == "resumed":  # the previous run's time: not idle instances
                ax.axvspan(iv.start, iv.end, facecolor="none", edgecolor="0.6", hatch="//", linewidth=0,
                           label="before the resume")
                continue
            color = version_color(iv.version or 0) if iv.version is not None else UNVERSIONED_COLOR
            ax.broken_barh([(iv.start, iv.end - iv.start)], (row[iv.track] - 0.15, 0.3), facecolors=color)
        peak = max((max(c for _, c in concurrency(ivs)) for ivs in requests.values() if ivs), default=1) or 1
        for track, ivs in requests.items():
            pts = concurrency(ivs)
            ax.step([t for t, _ in pts], [row[track] - 0.4 + 0.8 * c / peak for _, c in pts], where="post",
                    color="black", linewidth=0.8)
        ax.set_yticks(range(len(tracks)))
        ax.set_yticklabels(tracks)
        ax.set_xlabel("seconds")
        ax.set_title(title)
        if 0 < len(seen_versions) <= len(VERSION_COLORS):  # colours repeat; a longer legend hides the plot
            ax.legend(loc="upper right", fontsize="small", ncol=min(len(seen_versions), 6))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


#: version colours: matplotlib's tab10 without its grey, which is kept for spans of no version
#: (checkpoints), so that no version looks like a checkpoint bar
VERSION_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
UNVERSIONED_COLOR = "0.3"


def version_color(version: int) -> str:
    return VERSION_COLORS[version % len(VERSION_COLORS)]


def concurrency(intervals: list[Interval]) -> list[tuple[float, int]]:
    """Step curve of how many intervals are open: [(time, count)] at every change."""
    events = sorted([(iv.start, 1) for iv in intervals] + [(iv.end, -1) for iv in intervals])
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, n))
    return out or [(0.0, 0)]


def _track_key(track: str) -> tuple[int, str]:
    return (0 if track.startswith("trainer") else 1, track)
