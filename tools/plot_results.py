"""Draw the plots of docs/results/ from the data files in examples/results/.

WHY a script: the PNGs in docs/results/ are pictures of measured data, so they are regenerated from
the files the measurements wrote (``dora bench``'s ``bench.json``) or from the tables they are
quoted in (``examples/results/sim_tables.json``), never drawn by hand. Run it after replacing one of
those files::

    python tools/plot_results.py                # writes docs/results/bench_modes.png, sim_speedup.png,
                                                # tool_use_rl.png
    python tools/plot_results.py --out /tmp/x   # somewhere else

Plots:

* ``bench_modes.png``: the current bench table's run (``bench_cpu_ci10.json``, docs/results/bench.md):
  per variant it ran, each run's throughput (prompt+response tok/s) with the median over its runs,
  and each run's efficiency (throughput / the bound of its round).
* ``sim_speedup.png``: simulated throughput over sync per mode at four scales (the paper's benchmark
  on 64 and 128 GPUs, the MoE config on 4,096 and 16,384 accelerators), with the paper's own ratios
  where it reports them.
* ``tool_use_rl.png``: the CPU tool-use example's RL run (``tool_use_rl_steps.json``: the run's
  ``steps.jsonl`` reduced to step, ``reward/mean`` and ``env/tool_use_rate``): both per step and
  their 10-step trailing means.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "examples" / "results"
BENCH_FILES = ("bench_cpu_ci10.json",)
VARIANTS = ("sync_colocated", "sync", "one_step_off", "partial", "dora_s1", "dora_s3")
LABELS = {"sync_colocated": "sync\n(colocated)", "sync": "sync", "one_step_off": "one_step\n_off",
          "partial": "partial", "dora_s1": "DORA\nS=1", "dora_s3": "DORA\nS=3", "dora": "DORA",
          "dora_elastic": "DORA +\nelastic"}
SIM_MODES = ("one_step_off", "partial", "dora", "dora_elastic")
LEGEND = {"one_step_off": "one_step_off", "partial": "partial", "dora": "DORA", "dora_elastic": "DORA + elastic colocation"}

log = logging.getLogger("plot_results")


def bench_runs(paths: list[Path]) -> dict[str, list[tuple[float, float]]]:
    """Variant -> [(throughput, efficiency)] over every run of every file; a run's efficiency is its
    throughput over the bound (min of rollout alone and training alone) of its own round."""
    out: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for path in paths:
        data = json.loads(path.read_text())
        bounds = [min(r["rollout_tokens_per_s"], r["training_tokens_per_s"]) for r in data["limits"]["rounds"]]
        for variant in VARIANTS:
            for k, run in enumerate(data["runs"].get(variant, [])):
                tput = float(run["throughput_tokens_per_s"])
                out[variant].append((tput, tput / bounds[k]))
    return out


def plot_bench(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = bench_runs(paths)
    variants = [v for v in VARIANTS if runs[v]]  # those the run measured
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, idx, title in ((ax1, 0, "throughput (prompt+response tok/s)"), (ax2, 1, "efficiency (run / bound of its round)")):
        for x, variant in enumerate(variants):
            values = [r[idx] for r in runs[variant]]
            colour = "tab:red" if variant.startswith("dora") else "tab:gray"
            ax.bar(x, statistics.median(values), color=colour, alpha=0.35, width=0.7)
            ax.scatter([x] * len(values), values, color=colour, s=12, zorder=3)
        ax.set_xticks(range(len(variants)), [LABELS[v] for v in variants], fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax2.axhline(1.0, color="black", lw=0.8, ls="--")
    n = len(runs[variants[0]])
    fig.suptitle(f"dora bench, configs/bench/cpu_longtail.yaml: bars = median of {n} runs, dots = runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def plot_sim(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = json.loads(path.read_text())["scales"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.2
    colours = {"one_step_off": "tab:blue", "partial": "tab:green", "dora": "tab:red", "dora_elastic": "darkred"}
    for m, mode in enumerate(SIM_MODES):
        xs, ys = [], []
        for s, scale in enumerate(scales):
            t = scale["throughput"]
            if mode in t:
                xs.append(s + (m - 1.5) * width)
                ys.append(t[mode] / t["sync"])
        ax.bar(xs, ys, width=width, color=colours[mode], label=LEGEND[mode])
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.03, f"{y:.2f}", ha="center", fontsize=6)
    px, py = [], []
    for s, scale in enumerate(scales):
        paper = scale.get("paper")
        if paper:
            for m, mode in enumerate(SIM_MODES):
                if mode in paper:
                    px.append(s + (m - 1.5) * width)
                    py.append(paper[mode] / paper["sync"])
    ax.scatter(px, py, marker="_", s=160, color="black", zorder=3, label="the paper")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(scales)), [s["name"] for s in scales], fontsize=8)
    ax.set_ylabel("throughput / sync", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(fontsize=7, ncol=5, loc="upper left")
    ax.set_ylim(0, max(py + [3.3]) + 0.4)
    ax.set_title("dora simulate: speed-up over sync (S=3)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def plot_tool_use(path: Path, out: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(path.read_text())["steps"]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for key, label, colour in (("env/tool_use_rate", "tool-use rate", "tab:blue"), ("reward/mean", "reward", "tab:red")):
        values = [r[key] for r in rows]
        trailing = [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]
        ax.plot(steps, values, color=colour, alpha=0.25, lw=0.8)
        ax.plot(steps, trailing, color=colour, lw=1.8, label=f"{label} ({window}-step trailing mean)")
    ax.set_xlabel("RL step", fontsize=8)
    ax.set_ylim(0, 1)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("configs/cpu_tool_use.yaml: the policy learns to call its calculator", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the data files (examples/results)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="folder the PNGs go to")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_bench([args.results / name for name in BENCH_FILES], args.out / "bench_modes.png")
    plot_sim(args.results / "sim_tables.json", args.out / "sim_speedup.png")
    plot_tool_use(args.results / "tool_use_rl_steps.json", args.out / "tool_use_rl.png")
    for name in ("bench_modes.png", "sim_speedup.png", "tool_use_rl.png"):
        log.info("wrote %s (%d KB)", args.out / name, (args.out / name).stat().st_size // 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
