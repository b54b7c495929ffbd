"""``overview.png``: one figure that tells the story of a run from its ``steps.jsonl`` rows.

Why a picture of its own: the numbers exist (``steps.jsonl``, ``summary.json``, TensorBoard) but
whether a run learned, how fast it went, whether the trainer starved, how stale its samples were
and what weight sync cost are five questions a reader should answer at a glance, side by side, on
the same step axis. The panels follow the TensorBoard custom-scalars layout
(:data:`~dora_megatron.observability.tensorboard.DORA_LAYOUT`), so both tell the same story.

:func:`overview_figure` is a pure function of the step rows (the recorder's scalars, as
``dora train`` and ``dora simulate`` write them) and optionally the run's ``summary.json``
(held-out rates, the staleness histogram of every consumed group, the run-level shares). Long runs
stay readable: per-step series are drawn faint with a rolling mean on top. Agg backend, the
colours of :mod:`.timeline`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from dora_megatron.observability.timeline import VERSION_COLORS

#: panel titles, in reading order (left to right, top to bottom); tests look panels up by them
PANELS = (
    "reward and held-out exact rate",
    "throughput (tokens/s)",
    "trainer wait and rollout utilisation",
    "staleness of the consumed groups",
    "staleness and live versions per step",
    "weight sync and rebalance",
)
BLUE, ORANGE, GREEN, RED, PURPLE = VERSION_COLORS[:5]


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``steps.jsonl`` (blank lines skipped)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON object ({err})") from err
    return rows


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) is not None else math.nan for r in rows]


def _ratio(rows: Sequence[Mapping[str, Any]], num: str, den: str) -> list[float]:
    out = []
    for r in rows:
        a, b = r.get(num), r.get(den)
        out.append(float(a) / float(b) if a is not None and b else math.nan)
    return out


def _rolling(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` defined values at each point (NaN where none is)."""
    out, buf = [], []
    for v in values:
        buf.append(v)
        if len(buf) > window:
            buf.pop(0)
        defined = [x for x in buf if not math.isnan(x)]
        out.append(sum(defined) / len(defined) if defined else math.nan)
    return out


def _has(values: list[float]) -> bool:
    return any(not math.isnan(v) for v in values)


def _line(ax, steps, values, color, label, window, style="-"):
    """Per-step values faint, their rolling mean solid (just the values when the run is short)."""
    if not _has(values):
        return
    if window > 1:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8, linestyle=style)
        ax.plot(steps, _rolling(values, window), color=color, linewidth=1.6, linestyle=style,
                label=f"{label} (mean of {window})")
    else:
        ax.plot(steps, values, color=color, linewidth=1.4, linestyle=style, label=label)


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def overview_figure(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None = None, title: str = ""):
    """The overview figure of ``rows`` (``steps.jsonl`` rows, one per step, in step order); the
    caller saves and closes it. ``summary``: the run's ``summary.json`` (optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no step rows to draw an overview from")
    summary = summary or {}
    steps = [int(r["step"]) for r in rows]
    window = max(1, len(rows) // 20)
    fig, grid = plt.subplots(2, 3, figsize=(15, 7.5))
    axes = grid.ravel()
    for ax, name in zip(axes, PANELS):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")

    ax = axes[0]  # is it learning?
    _line(ax, steps, _series(rows, "reward/mean"), BLUE, "reward mean", window)
    _line(ax, steps, _series(rows, "reward/exact_fraction"), GREEN, "exact-answer share", window)
    initial, final = summary.get("heldout_exact_initial"), summary.get("heldout_exact_final")
    if final is not None:
        ax.plot([steps[0], steps[-1]], [initial, final], color=RED, linestyle="--", marker="s",
                label=f"held-out exact {initial:.2f} -> {final:.2f}")
    if not ax.lines:
        ax.text(0.5, 0.5, "no rewards (simulated run)", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_ylabel("reward / share")

    ax = axes[1]  # how fast?
    _line(ax, steps, _series(rows, "perf/throughput_tokens_per_s"), BLUE, "run so far", 1)
    _line(ax, steps, _series(rows, "perf/trainer_tokens_per_s"), ORANGE, "trainer's own step", window)
    if summary.get("throughput_tokens_per_s") is not None:
        ax.axhline(summary["throughput_tokens_per_s"], color="0.3", linestyle=":", linewidth=1,
                   label=f"window {summary['throughput_tokens_per_s']:.0f} tok/s")
    ax.set_ylabel("tokens/s")

    ax = axes[2]  # does the trainer starve? are the engines busy?
    _line(ax, steps, _ratio(rows, "perf/wait_time_s", "perf/step_time_s"), RED, "trainer wait share of the step", window)
    _line(ax, steps, _series(rows, "perf/rollout_only_fraction"), ORANGE, "trainer wait share, run so far", 1)
    _line(ax, steps, _series(rows, "perf/rollout_utilization"), GREEN, "rollout slot utilisation, so far", 1)
    _line(ax, steps, _ratio(rows, "perf/sync_time_s", "perf/step_time_s"), "0.3", "trainer sync share of the step",
          window, ":")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share")

    ax = axes[3]  # how off-policy?
    hist = {int(k): int(v) for k, v in (summary.get("staleness_histogram") or {}).items()}
    what = "groups"
    if not hist:  # no summary: the steps' maximum staleness
        what = "steps (by their max)"
        for s in _series(rows, "staleness/max"):
            if not math.isnan(s):
                hist[int(s)] = hist.get(int(s), 0) + 1
    if hist:
        total = sum(hist.values())
        ax.bar(list(hist), [v / total for v in hist.values()], color=PURPLE, width=0.7)
        ax.set_xticks(sorted(hist))
        bound = summary.get("max_staleness")
        if bound is not None:
            ax.axvline(bound + 0.5, color=RED, linestyle="--", linewidth=1, label=f"bound {bound}")
    ax.set_xlabel("staleness t - w")
    ax.set_ylabel(f"share of {what}")

    ax = axes[4]
    _line(ax, steps, _series(rows, "staleness/mean"), PURPLE, "staleness mean", window)
    _line(ax, steps, _series(rows, "staleness/max"), RED, "staleness max", window, "--")
    live = _series(rows, "versions/live")
    if _has(live):
        ax.step(steps, live, where="post", color=BLUE, linewidth=1.2, label="live versions")
    ax.set_ylabel("t - w / versions")

    ax = axes[5]  # what does moving weights cost?
    _line(ax, steps, _series(rows, "perf/weight_sync_time_s"), BLUE, "weight loads (instance-s)", window)
    _line(ax, steps, _series(rows, "perf/rebalance_time_s"), ORANGE, "of which rebalance (instance-s)", window, "--")
    ax.set_ylabel("instance-seconds of weight loads per step")
    migrations = rows[-1].get("migrations/count")
    ax.set_title(f"{PANELS[5]}\nrun: weight sync {_pct(summary.get('weight_sync_fraction'))}, rebalance "
                 f"{_pct(summary.get('rebalance_fraction'))}, migrations {migrations if migrations is not None else 'n/a'}",
                 fontsize="medium")

    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small", loc="best", framealpha=0.7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_overview(path: str | Path, rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None = None,
                   title: str = "") -> Path:
    """Draw :func:`overview_figure` to ``path`` (PNG), through a temporary file renamed over it: a
    viewer open on a run's ``overview.png`` while a checkpoint redraws it never reads half a file."""
    import os

    import matplotlib.pyplot as plt

    fig = overview_figure(rows, summary, title)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    os.replace(tmp, path)
    return path


class CheckpointOverviews:
    """``overview.png`` redrawn at each checkpoint of a running job, on a
    :class:`~dora_megatron.observability.background.BackgroundWriter` (a figure takes a second or
    more: never in the controller's loop turn).

    The loop calls :meth:`step` after each trained step (a copy of the step's scalars and the
    staleness of its groups: cheap) and :meth:`checkpoint` at each checkpoint's cut, which queues
    the drawing of the rows so far. The run has no ``summary.json`` yet: the staleness panel shows
    the histogram of every group consumed so far, as the final figure does."""

    def __init__(self, path: str | Path, writer: Any, *, max_staleness: int | None = None, title: str = "",
                 rows: Sequence[Mapping[str, Any]] = (), staleness: Mapping[int, int] | None = None) -> None:
        self.path = Path(path)
        self.writer = writer
        self.max_staleness = max_staleness
        self.title = title
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]  # a resumed run's earlier steps
        self.histogram: dict[int, int] = dict(staleness or {})

    def step(self, step: int, scalars: Mapping[str, Any], staleness: Sequence[int] = ()) -> None:
        self.rows.append({"step": int(step), **scalars})
        for s in staleness:
            self.histogram[int(s)] = self.histogram.get(int(s), 0) + 1

    def checkpoint(self, version: int) -> bool:
        """Queue the drawing of the rows so far; False when there is none yet or it was not queued."""
        if not self.rows:
            return False
        summary = {"staleness_histogram": dict(self.histogram), "max_staleness": self.max_staleness}
        title = f"{self.title} (checkpoint v{version})" if self.title else f"checkpoint v{version}"
        return self.writer.submit(f"overview at checkpoint v{version}", write_overview, self.path, list(self.rows),
                                  summary, title)


def write_run_overview(run_dir: str | Path, title: str = "") -> Path | None:
    """``RUN_DIR/overview.png`` from ``RUN_DIR/steps.jsonl`` and ``summary.json`` (None when the
    run trained no step)."""
    run_dir = Path(run_dir)
    rows = read_steps(run_dir / "steps.jsonl") if (run_dir / "steps.jsonl").is_file() else []
    if not rows:
        return None
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return write_overview(run_dir / "overview.png", rows, summary, title)
