"""PNG plots of a simulation: per-step series and the instance x time timeline coloured by version.

WHY separate: matplotlib is slow to import and only the CLI needs pictures; the engine and the
tests stay free of it. Uses the Agg backend (no display on clusters or CI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

STATE_HATCH = {"switching": "////", "paused": "..", "idle": None, "busy": None}


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


def plot_timeline(timeline: Sequence[tuple[str, float, float, int | None, str]], path: str | Path,
                  title: str = "") -> Path:
    """Instance x time bars coloured by the version each instance holds (grey: idle, hatched:
    loading weights, dotted: paused for training)."""
    plt = _plt()
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    ids = sorted({row[0] for row in timeline}, key=lambda s: (s[0], int(s[1:]) if s[1:].isdigit() else 0))
    ypos = {iid: i for i, iid in enumerate(ids)}
    cmap = colormaps["tab10"]
    fig, ax = plt.subplots(figsize=(14, max(3, 0.12 * len(ids) + 1.5)))
    by_color: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    rows: dict[tuple[Any, ...], list[int]] = {}
    for iid, t0, t1, version, state in timeline:
        key = (version, state)
        by_color.setdefault(key, []).append((t0, t1 - t0))
        rows.setdefault(key, []).append(ypos[iid])
    versions = sorted({v for v, _ in by_color if v is not None})
    for (version, state), spans in by_color.items():
        color = "lightgrey" if state == "idle" or version is None else cmap(version % 10)
        for (x, w), y in zip(spans, rows[(version, state)]):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=color, hatch=STATE_HATCH.get(state),
                           edgecolor="none" if STATE_HATCH.get(state) is None else "black", linewidth=0)
    handles = [Patch(color=cmap(v % 10), label=f"v{v}") for v in versions[-10:]]
    handles.append(Patch(color="lightgrey", label="idle"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=min(6, len(handles)))
    ax.set_yticks(range(len(ids)))
    ax.set_yticklabels(ids, fontsize=6)
    ax.set_xlabel("virtual time (s)")
    ax.set_title(title or "rollout instances by version")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
