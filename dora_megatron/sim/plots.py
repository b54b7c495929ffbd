"""PNG plots of a simulation: per-step series, and its timeline as the intervals ``dora train``
records (drawn by :mod:`dora_megatron.observability.timeline_plot`).

WHY separate: matplotlib is slow to import and only the CLI needs pictures; the engine and the
tests stay free of it. Uses the Agg backend (no display on clusters or CI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_steps(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Step time, trainer wait and staleness per step, one line per mode."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, res in results.items():
        s = res["series"]
        axes[0].plot(s["step"], s["step_time_s"], marker="o", label=mode)
        axes[1].plot(s["step"], s["wait_s"], marker="o", label=mode)
        axes[2].plot(s["step"], [x if x is not None else float("nan") for x in s["mean_staleness"]], marker="o", label=mode)
    for ax, title in zip(axes, ("step time (s)", "trainer waits for data (s)", "mean staleness t - w")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline_intervals(timeline: Sequence[tuple[str, float, float, int | None, str]],
                       step_rows: Sequence[dict[str, Any]]) -> list:
    """The simulator's instance segments ``(instance, t0, t1, version, state)`` and step rows as the
    :class:`~dora_megatron.observability.timeline.Interval` list ``dora train`` records, so both
    draw the same ``timeline.png`` (:func:`~dora_megatron.observability.timeline_plot.draw_timeline`):
    one version span per stretch an instance held a version (busy or idle), a weight load per
    ``switching`` segment, and the trainer's steps (``perf/train_time_s`` before each step's end,
    the running sum of ``perf/step_time_s``; step k produces version k + 1)."""
    from dora_megatron.observability.timeline import Interval

    out: list = []
    by_instance: dict[str, list[tuple[float, float, int | None, str]]] = {}
    for iid, t0, t1, version, state in timeline:
        by_instance.setdefault(iid, []).append((t0, t1, version, state))
    for iid, segments in by_instance.items():
        held: list[float | int] | None = None  # [start, end, version] of the open version span
        for t0, t1, version, state in sorted(segments, key=lambda seg: seg[0]):
            if state == "switching":
                out.append(Interval(iid, "load weights", t0, t1, version, {"kind": "weight_sync"}))
            if held is not None and (held[2] != version or t0 > held[1] + 1e-9):
                out.append(Interval(iid, f"v{held[2]}", held[0], held[1], int(held[2]), {"kind": "version"}))
                held = None
            if version is None:
                continue
            held = [held[0] if held is not None else t0, t1, version]
        if held is not None:
            out.append(Interval(iid, f"v{held[2]}", held[0], held[1], int(held[2]), {"kind": "version"}))
    end = 0.0
    for row in step_rows:
        end += float(row.get("perf/step_time_s") or 0.0)
        train = float(row.get("perf/train_time_s") or 0.0)
        step = int(row["step"])
        out.append(Interval("trainer", f"step {step}", end - train, end, step, {"kind": "train", "produced": step + 1}))
    return out
