"""``timeline.png``: a window of a few steps in detail above the whole run by version age.

Why two panels: one picture of a whole run coloured by version id is a barcode (200 versions in
ten cycling colours: no version can be told from another). The mechanism of DORA -- versions
overlapping on the instances, an instance finishing its tail on its own version while the trainer
is already further, weights loaded, requests migrated -- is seen in a few steps; the health of
the whole run is seen in how OLD the versions the instances generate with are, which stays a
small number (0 .. the staleness bound) however long the run is.

* **detail** (top): the steps :func:`select_window` picks (``observability.timeline_window_steps``,
  by default the steady-state steps around the middle of the run). Rows: the trainer (its steps,
  labelled ``step N -> vN+1`` in the colour of the version they produce, broadcasts hatched,
  checkpoints grey), then one row per instance (the first :data:`DETAIL_MAX_INSTANCES`): the version it holds (its own colour, labelled
  on the bar and in the legend), weight loads hatched, migrations in as black triangles and the
  number of running requests as a black line.
* **whole run** (bottom): instances x time, each pixel the version age of the instance (trainer
  version - the version the instance generates with; the oldest in the pixel), a colourbar of
  the ages; the detail window is outlined. Drawn as an image of fixed width, so 10,000 steps cost
  the same picture as 10.

Pure functions of the recorded :class:`~dora_megatron.observability.timeline.Interval` list
(:class:`~dora_megatron.observability.timeline.Timeline` or a ``trace.json`` read back with
:meth:`~dora_megatron.observability.timeline.Timeline.from_chrome_trace`). Agg backend.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

#: pixels (time bins) of the whole-run panel
WHOLE_RUN_BINS = 1200
#: instances drawn as rows of the detail panel (the first ones by name); the whole-run panel has all
DETAIL_MAX_INSTANCES = 16
#: versions in the detail window get these colours in order (tab20 without its greys, dark then light)
WINDOW_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
                  "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
                  "#dbdb8d", "#9edae5")

#: spans of no version (checkpoints): a grey no version colour has
UNVERSIONED_COLOR = "0.3"


def concurrency(intervals: Sequence) -> list[tuple[float, int]]:
    """Step curve of how many intervals are open: [(time, count)] at every change."""
    events = sorted([(iv.start, 1) for iv in intervals] + [(iv.end, -1) for iv in intervals])
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, n))
    return out or [(0.0, 0)]


@dataclass(frozen=True)
class StepSpan:
    """One trainer step as the timeline recorded it: ``/train`` ran from ``start`` to ``end`` and
    produced weights ``version``."""

    step: int
    start: float
    end: float
    version: int


def trainer_steps(intervals: Sequence) -> list[StepSpan]:
    """The trainer's ``train`` spans in order of their end (a step produces ``args["produced"]``,
    or step + 1 when the recording predates that argument)."""
    out = []
    for iv in intervals:
        if iv.track == "trainer" and iv.args.get("kind") == "train":
            step = int(iv.version if iv.version is not None else iv.name.split()[-1])
            out.append(StepSpan(step, iv.start, iv.end, int(iv.args.get("produced", step + 1))))
    return sorted(out, key=lambda s: (s.end, s.step))


def select_window(n_steps: int, window_steps: int, warmup_steps: int = 0) -> tuple[int, int]:
    """Indices ``[lo, hi)`` of the ``window_steps`` steps of a run of ``n_steps`` to draw in detail:
    the middle of the steady state, which starts after ``warmup_steps`` and after the first step
    (it waits for a whole first rollout, the others do not). Every step when the run has no more
    than ``window_steps``; the window stays inside the run."""
    if int(window_steps) < 1:
        raise ValueError(f"observability.timeline_window_steps: {window_steps}; the detail window needs at least 1 step")
    if n_steps <= window_steps:
        return 0, max(0, n_steps)
    first = min(max(1, int(warmup_steps)), n_steps - window_steps)
    lo = (first + n_steps) // 2 - window_steps // 2
    lo = max(first, min(lo, n_steps - window_steps))
    return lo, lo + window_steps


def window_times(steps: Sequence[StepSpan], lo: int, hi: int, t_end: float) -> tuple[float, float]:
    """Seconds the window ``[lo, hi)`` of ``steps`` covers: from the end of the step before it (the
    trainer starts waiting for step ``lo``'s data there) to the end of step ``hi - 1``."""
    if not steps or hi <= lo:
        return 0.0, t_end
    t0 = steps[lo - 1].end if lo > 0 else 0.0
    return t0, steps[hi - 1].end


class TrainerVersion:
    """The trainer's newest version at a time: the one produced by the last step that ended."""

    def __init__(self, steps: Sequence[StepSpan]) -> None:
        self.ends = [s.end for s in steps]
        self.versions = [s.version for s in steps]
        self.initial = (steps[0].version - 1) if steps else 0

    def at(self, t: float, before: bool = False) -> int:
        """Version at ``t`` (``before``: just before ``t``, a step ending exactly at ``t`` not counted)."""
        k = (bisect.bisect_left if before else bisect.bisect_right)(self.ends, t)
        return self.versions[k - 1] if k else self.initial


def age_image(rows: Sequence[str], version_spans: Sequence, steps: Sequence[StepSpan], t0: float, t1: float,
              bins: int = WHOLE_RUN_BINS):
    """``len(rows) x bins`` array of version ages over ``[t0, t1]``: in each pixel the oldest age
    the row's instance held (trainer version - held version; the trainer's version only grows,
    so the oldest is at the pixel's or the span's end); NaN where the instance held none."""
    import numpy as np

    img = np.full((len(rows), bins), -np.inf)
    row = {r: i for i, r in enumerate(rows)}
    spans = [(row[iv.track], iv.start, iv.end, iv.version) for iv in version_spans
             if iv.track in row and iv.version is not None and iv.end > t0 and iv.start < t1 and t1 > t0]
    if not spans:
        return np.full((len(rows), bins), np.nan)
    r, a, b, v = (np.asarray(x, dtype=float) for x in zip(*spans))
    width = (t1 - t0) / bins
    ja = np.clip(np.floor((a - t0) / width), 0, bins - 1).astype(int)
    jb = np.maximum(ja, np.clip(np.ceil((b - t0) / width) - 1, 0, bins - 1).astype(int))
    # every (span, pixel) pair at once: a span covers pixels ja..jb
    counts = jb - ja + 1
    which = np.repeat(np.arange(len(spans)), counts)
    j = ja[which] + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    right = np.minimum(t0 + (j + 1) * width, b[which])  # the latest moment of the span in each pixel
    ends = np.asarray([s.end for s in steps], dtype=float)
    versions = np.asarray([s.version for s in steps] or [0], dtype=float)
    initial = float(steps[0].version - 1) if steps else 0.0
    k = np.searchsorted(ends, right, side="left")  # steps ended strictly before it
    trainer = np.where(k > 0, versions[np.maximum(k - 1, 0)], initial)
    age = np.maximum(trainer - v[which], 0.0)
    flat = img.reshape(-1)
    np.maximum.at(flat, r[which].astype(int) * bins + j, age)
    img[np.isneginf(img)] = np.nan
    return img


def _track_key(track: str) -> tuple:
    digits = "".join(c for c in track if c.isdigit())
    return (track.rstrip("0123456789"), int(digits) if digits else -1, track)


def _clip(iv, t0: float, t1: float) -> tuple[float, float] | None:
    a, b = max(iv.start, t0), min(iv.end, t1)
    return (a, b - a) if b > a else None


def draw_timeline(intervals: Sequence, path: str | Path, *, window_steps: int = 6, warmup_steps: int = 0,
                  title: str = "") -> Path:
    """Write the two-panel timeline PNG of ``intervals`` to ``path`` (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    path = Path(path)
    steps = trainer_steps(intervals)
    t_end = max((iv.end for iv in intervals), default=1.0) or 1.0
    lo, hi = select_window(len(steps), window_steps, warmup_steps)
    w0, w1 = window_times(steps, lo, hi, t_end)
    if w1 <= w0:
        w0, w1 = 0.0, t_end
    instances = sorted({iv.track for iv in intervals if iv.track != "trainer"}, key=_track_key)
    version_spans = [iv for iv in intervals if iv.args.get("kind") == "version"]
    resumed = [iv for iv in intervals if iv.args.get("kind") == "resumed"]

    detail = instances[:DETAIL_MAX_INSTANCES]
    n_rows = len(detail) + 1
    whole_h = min(4.0, max(1.2, 0.22 * len(instances) + 0.8))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(14, 0.55 * n_rows + 2.2 + whole_h + 1.4),
                                  gridspec_kw={"height_ratios": [0.55 * n_rows + 1.2, whole_h]})

    # ---- detail: the window's versions, each its own colour --------------------------------
    in_window = [iv for iv in intervals if iv.end > w0 and iv.start < w1]
    shown = sorted({iv.version for iv in in_window if iv.args.get("kind") in ("version", "weight_sync")
                    and iv.version is not None and iv.track in detail} | {s.version for s in steps[lo:hi]})
    colour = {v: WINDOW_PALETTE[i % len(WINDOW_PALETTE)] for i, v in enumerate(shown)}
    row = {"trainer": 0, **{t: i + 1 for i, t in enumerate(detail)}}
    span_w = w1 - w0
    label_fs = "small" if n_rows <= 12 else "x-small"

    def label(x: float, w: float, y: float, *texts: str, fs=label_fs) -> None:
        """The first of ``texts`` that fits in the bar (none when none does), on a light box so a
        requests line crossing it does not hide it."""
        for text in texts:
            if w >= span_w * 0.0075 * max(2, max(len(line) for line in text.splitlines())):
                ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=fs, clip_on=True,
                        bbox={"facecolor": "white", "alpha": 0.6, "linewidth": 0, "pad": 1})
                return

    for iv in in_window:
        kind = iv.args.get("kind")
        seg = _clip(iv, w0, w1)
        if seg is None or iv.track not in row:
            continue
        y = row[iv.track]
        if kind == "version":
            ax.broken_barh([seg], (y - 0.4, 0.8), facecolors=colour.get(iv.version, "0.8"), alpha=0.55,
                           edgecolor="white", linewidth=0.8)
            label(*seg, y + 0.22, f"v{iv.version}", f"{iv.version}")
        elif kind == "weight_sync":
            ax.broken_barh([seg], (y - 0.4, 0.8), facecolors="none", edgecolor="0.15", hatch="////", linewidth=0)
        elif kind == "migration":
            ax.plot([seg[0]], [y + 0.3], marker="v", color="black", markersize=6, linestyle="none")
        elif kind == "train":
            produced = int(iv.args.get("produced", (iv.version or 0) + 1))
            ax.broken_barh([seg], (y - 0.35, 0.7), facecolors=colour.get(produced, "0.6"), edgecolor="black",
                           linewidth=0.6)
            label(*seg, y, f"step {iv.version}\n\u2192 v{produced}", f"{iv.version}", fs="x-small")
        elif kind == "broadcast":
            ax.broken_barh([seg], (y - 0.45, 0.15), facecolors="black", linewidth=0)
        elif kind == "checkpoint":
            ax.broken_barh([seg], (y + 0.3, 0.15), facecolors=UNVERSIONED_COLOR, linewidth=0)
        elif kind == "resumed":
            ax.axvspan(seg[0], seg[0] + seg[1], facecolor="none", edgecolor="0.6", hatch="//", linewidth=0)
    requests: dict[str, list] = {}
    for iv in in_window:
        if iv.args.get("kind") == "request":
            requests.setdefault(iv.track, []).append(iv)
    peak = max((max(c for _, c in concurrency(ivs)) for ivs in requests.values()), default=1) or 1
    for track, ivs in requests.items():
        if track not in row:
            continue
        pts = [(t, c) for t, c in concurrency(ivs)]
        y = row[track]
        ax.step([min(max(t, w0), w1) for t, _ in pts], [y + 0.4 - 0.8 * c / peak for _, c in pts], where="post",
                color="black", linewidth=0.7)
    for s in steps[lo:hi]:  # a new version exists: the instances may switch to it from here
        ax.axvline(s.end, color=colour.get(s.version, "0.5"), linestyle=":", linewidth=1.0)
    ax.set_xlim(w0, w1)
    ax.set_ylim(n_rows - 0.5, -0.6)
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(["trainer"] + detail, fontsize="small")
    ax.set_xlabel("seconds since the start of the run")
    what = (f"steps {steps[lo].step}-{steps[hi - 1].step} of {len(steps)}" if hi > lo else "no trained step")
    if len(detail) < len(instances):
        what += f", {len(detail)} of {len(instances)} instances"
    ax.set_title(f"{title + ': ' if title else ''}detail, {what} (each version its own colour)", fontsize="medium")
    handles = [Patch(facecolor=colour[v], alpha=0.7, label=f"v{v}") for v in shown]
    kinds = {iv.args.get("kind") for iv in in_window}
    marks = {"weight_sync": Patch(facecolor="none", edgecolor="0.15", hatch="////", label="loading weights"),
             "migration": Line2D([], [], marker="v", color="black", linestyle="none", label="migration in"),
             "request": Line2D([], [], color="black", linewidth=0.7, label=f"running requests (row = {peak})"),
             "broadcast": Patch(facecolor="black", label="trainer broadcast"),
             "checkpoint": Patch(facecolor=UNVERSIONED_COLOR, label="checkpoint")}
    handles += [h for kind, h in marks.items() if kind in kinds]  # only what the window shows
    if hi > lo:
        handles.append(Line2D([], [], color="0.4", linestyle=":", label="a step ends: new version"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="x-small",
              ncol=1 if len(handles) <= 16 else 2, frameon=False)

    # ---- whole run: version age per instance --------------------------------------------------
    img = age_image(instances, version_spans, steps, 0.0, t_end)
    finite = img[np.isfinite(img)]
    max_age = int(finite.max()) if finite.size else 0
    ages = list(range(max_age + 1))
    cmap = ListedColormap([matplotlib.colormaps["viridis_r"](x)
                           for x in np.linspace(0.05, 0.95, max(2, len(ages)))][:len(ages)]).with_extremes(bad="white")
    norm = BoundaryNorm([a - 0.5 for a in ages] + [max_age + 0.5], cmap.N)
    im = ax2.imshow(np.ma.masked_invalid(img), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                    extent=(0.0, t_end, len(instances) - 0.5, -0.5))
    for iv in resumed:
        ax2.axvspan(iv.start, iv.end, facecolor="none", edgecolor="0.6", hatch="//", linewidth=0)
    ax2.add_patch(matplotlib.patches.Rectangle((w0, -0.5), w1 - w0, len(instances), fill=False, edgecolor="red",
                                               linewidth=1.2))
    step_ticks = _step_axis(ax2, steps, t_end)
    if len(instances) <= 24:
        ax2.set_yticks(range(len(instances)))
        ax2.set_yticklabels(instances, fontsize="small")
    else:
        ax2.set_ylabel(f"{len(instances)} instances")
    ax2.set_xlabel("seconds since the start of the run" + (" (top: trainer step)" if step_ticks else ""))
    ax2.set_title(f"whole run, {len(steps)} steps: version age = trainer version \u2212 generating version "
                  "(red box: the detail window)", fontsize="medium")
    bar = fig.colorbar(im, ax=ax2, ticks=ages, pad=0.01, fraction=0.03)
    bar.set_label("version age", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _step_axis(ax, steps: Sequence[StepSpan], t_end: float) -> bool:
    """A secondary x axis on top of ``ax`` naming the trainer step that ends at a tick."""
    if not steps:
        return False
    top = ax.secondary_xaxis("top")
    n = len(steps)
    stride = max(1, n // 10)
    picks = steps[stride - 1::stride]
    top.set_xticks([s.end for s in picks])
    top.set_xticklabels([str(s.step) for s in picks], fontsize="x-small")
    return True
