"""``dora bench``: every rollout mode on the same workload, measured side by side in one run.

Same model (one warm-started directory shared by all variants), same prompts
(``data.seed``), same engines and trainer, same total CPU cores, same number of
training steps. Asynchronous variants run disaggregated (engines pinned to their
cores, the trainer to its own); ``sync`` is measured both disaggregated and
colocated (every phase may use all cores, as the paper's synchronous baseline
does) and the faster of the two is the baseline of the ratios.

Runs are interleaved seed-major (:func:`run_order`): every variant's seed k runs before any
variant's seed k+1, so load drift on a shared machine spreads over every variant instead of
landing on whichever runs at that time. Before each round the two capacities of the disaggregated
placement are measured (:mod:`.capacity`, ``bench.limits``); each run's throughput divided by
min(the two) of its round is its ``efficiency``.

Outputs in ``DIR``: ``bench.json`` (each run's summary; per variant the means, the median and
min-max of throughput and efficiency; ``limits``; ratios dora/sync, dora/one_step_off,
dora/partial of median throughput and step time, and in ``ratio_ci`` each DORA ratio paired by
round with its confidence interval; ``bound_exceeded``: runs above their round's bound;
``learning``: per variant and seed the reward curve and the time-to-reward, :mod:`.bench_stats`),
``bench.md`` (the tables), ``reward.png`` (reward per step and per wall second, seed means),
``reward_curves.png`` (every seed's reward against wall seconds, the reward level drawn),
``overview.png`` (each variant's run overview, side by side).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

from dora_megatron.config.loader import apply_overrides, from_dict, to_dict, validate
from dora_megatron.config.schema import DoraConfig
from dora_megatron.launch.bench_stats import eval_curve, paired_ratio_ci, reward_curve, time_to_reward, trailing_mean
from dora_megatron.launch.capacity import bound, median_spread

log = logging.getLogger(__name__)

#: Variant -> overrides (dotted keys). "colocated" is handled by :func:`variant_config`.
VARIANTS: dict[str, dict[str, Any]] = {
    "sync_colocated": {"orchestrator.mode": "sync", "_colocated": True},
    "sync": {"orchestrator.mode": "sync"},
    "one_step_off": {"orchestrator.mode": "one_step_off"},
    "partial": {"orchestrator.mode": "partial"},
    "dora": {"orchestrator.mode": "dora"},  # S as configured: the reference of the ablations
    "dora_s1": {"orchestrator.mode": "dora", "orchestrator.max_staleness": 1},
    "dora_s3": {"orchestrator.mode": "dora", "orchestrator.max_staleness": 3},
    # ablations: one DORA mechanism off (S as configured)
    "dora_no_repartition": {"orchestrator.mode": "dora", "orchestrator.repartition": False},
    "dora_reprefill": {"orchestrator.mode": "dora", "controller.migration": "reprefill"},
    "dora_legacy_fill": {"orchestrator.mode": "dora", "orchestrator.legacy_fill": True},
    "dora_one_cap": {"orchestrator.mode": "dora", "_one_cap": True},
    # the same DORA workload on each rollout engine (vllm: the venv of tools/setup_vllm.sh)
    "dora_embedded": {"orchestrator.mode": "dora", "rollout.engine": "embedded"},
    "dora_vllm": {"orchestrator.mode": "dora", "rollout.engine": "vllm"},
}


def split_cores(n_cores: int, n_engines: int) -> tuple[list[int], list[int]]:
    """Disaggregated placement: engines get the first cores, the trainer the rest (at least one each)."""
    if n_cores < 2:
        return [0], [0]
    trainer = max(1, n_cores // (n_engines + 1))
    return list(range(n_cores - trainer)), list(range(n_cores - trainer, n_cores))


def variant_config(base: DoraConfig, name: str, seed_index: int, run_dir: Path, model_dir: Path, n_cores: int) -> DoraConfig:
    spec = dict(VARIANTS[name])
    colocated = spec.pop("_colocated", False)
    one_cap = spec.pop("_one_cap", False)
    data = to_dict(base)
    overrides = [f"{k}={json.dumps(v)}" for k, v in spec.items()]
    overrides += [f"run.run_dir={run_dir}", f"model.path={model_dir}", "model.warm_start=''",
                  f"run.seed={base.run.seed + seed_index}", "observability.progress=false"]
    if colocated:
        # every phase may use every core: the engines share them during rollout (one slice each, so
        # the rollout phase is not oversubscribed), the trainer uses all of them during training
        per_engine = max(1, n_cores // base.rollout.num_instances)
        overrides += ["launch.engine_cpus=[]", "launch.trainer_cpus=[]", f"rollout.threads_per_instance={per_engine}",
                      f"launch.trainer_threads={n_cores}"]
    else:
        engines, trainer = split_cores(n_cores, base.rollout.num_instances)
        per_engine = max(1, len(engines) // base.rollout.num_instances)
        overrides += [f"launch.engine_cpus={engines}", f"launch.trainer_cpus={trainer}",
                      f"rollout.threads_per_instance={per_engine}", f"launch.trainer_threads={len(trainer)}"]
    if one_cap:
        overrides.append(f"orchestrator.cap_after_rebalance={base.orchestrator.cap_before_rebalance}")
    cfg = from_dict(DoraConfig, apply_overrides(data, overrides))
    validate(cfg)
    return cfg


#: The name :func:`run_order` gives the capacity measurement of a round.
LIMITS = "limits"


def run_order(variants: list[str], seeds: int, limits: bool) -> list[tuple[int, str]]:
    """``(seed index, variant)`` in run order, seed-major: round k runs the limits (when measured)
    and then every variant's seed k, before any seed k+1."""
    head = [LIMITS] if limits else []
    return [(k, name) for k in range(seeds) for name in head + list(variants)]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _efficiencies(runs: list[dict[str, Any]], limits: list[dict[str, Any]]) -> list[float | None]:
    """Each run's throughput / the bound of its own round (runs and limits both in seed order)."""
    out = []
    for k, r in enumerate(runs):
        b = bound(limits[k]) if k < len(limits) else None
        t = r.get("throughput_tokens_per_s")
        out.append(t / b if t is not None and b else None)
    return out


def summarize_limits(limits: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max over the rounds of both capacities and of the per-round bound."""
    out: dict[str, Any] = {}
    for key, values in (("rollout_tokens_per_s", [x.get("rollout_tokens_per_s") for x in limits]),
                        ("training_tokens_per_s", [x.get("training_tokens_per_s") for x in limits]),
                        ("bound_tokens_per_s", [bound(x) for x in limits])):
        med, lo, hi = median_spread(values)
        out[key], out[key.replace("_tokens_per_s", "_min")], out[key.replace("_tokens_per_s", "_max")] = med, lo, hi
    b = out["bound_tokens_per_s"]
    out["bound_by"] = None if b is None else (
        "rollout" if out["rollout_tokens_per_s"] <= out["training_tokens_per_s"] else "training")
    out["rounds"] = list(limits)
    return out


def aggregate(runs: dict[str, list[dict[str, Any]]], baseline: str = "auto",
              limits: list[dict[str, Any]] | None = None, ci_level: float = 0.95) -> dict[str, Any]:
    """Per variant: means, median and min-max of throughput, efficiency (median over the rounds of
    throughput / that round's bound) when ``limits`` (one entry per seed round) are known; the
    headline ratios, of median throughput and median step time, and each DORA ratio's confidence
    interval (``ratio_ci``: paired by round, :func:`~.bench_stats.paired_ratio_ci`; ``runs[v][k]``
    is round k)."""
    keys = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "rollout_utilization",
            "reward_first", "reward_last", "wall_time_s", "max_consumed_staleness", "migrations", "reprefill_tokens")
    means: dict[str, dict[str, Any]] = {}
    for v, rs in runs.items():
        m = {k: _mean([r.get(k) for r in rs]) for k in keys}
        m["throughput_median"], m["throughput_min"], m["throughput_max"] = median_spread(
            [r.get("throughput_tokens_per_s") for r in rs])
        m["step_time_median"] = median_spread([r.get("mean_step_time_s") for r in rs])[0]
        m["seeds"] = len(rs)
        m["efficiency"], m["efficiency_min"], m["efficiency_max"] = (
            median_spread(_efficiencies(rs, limits)) if limits else (None, None, None))
        means[v] = m
    syncs = [v for v in ("sync", "sync_colocated") if v in means and means[v]["throughput_median"]]
    if baseline == "auto":
        base = max(syncs, key=lambda v: means[v]["throughput_median"]) if syncs else None
    else:
        base = baseline if baseline in means else None
    ratios: dict[str, Any] = {"sync_baseline": base}
    cis: dict[str, Any] = {}
    for dora in [v for v in means if v.startswith("dora")]:
        for other, label in ((base, "sync"), ("one_step_off", "one_step_off"), ("partial", "partial")):
            if other is None or other not in means:
                continue
            ci = paired_ratio_ci([r.get("throughput_tokens_per_s") for r in runs[dora]],
                                 [r.get("throughput_tokens_per_s") for r in runs[other]], ci_level)
            if ci is not None:
                cis[f"{dora}/{label}_throughput"] = ci.to_json()
            a, b = means[dora], means[other]
            if a["throughput_median"] and b["throughput_median"]:
                ratios[f"{dora}/{label}_throughput"] = a["throughput_median"] / b["throughput_median"]
            if a["step_time_median"] and b["step_time_median"]:
                ratios[f"{dora}/{label}_step_time_speedup"] = b["step_time_median"] / a["step_time_median"]
    out: dict[str, Any] = {"means": means, "ratios": ratios, "ratio_ci": cis}
    if limits:
        out["limits"] = summarize_limits(limits)
        out["bound_exceeded"] = [f"{v}-seed{k}" for v, rs in runs.items()
                                 for k, e in enumerate(_efficiencies(rs, limits)) if e is not None and e > 1.0]
    return out


def learning(run_dirs: dict[str, list[Path]], level: float, window: int, source: str = "trained") -> dict[str, Any]:
    """Per variant and seed (``run_dirs[v][k]``: round k): the reward curve (wall seconds, reward)
    and the time-to-reward at ``level`` (:func:`~.bench_stats.time_to_reward`; None: not reached),
    and the last point of the curve; per variant the seeds that got there and the median time of
    those that did. ``source`` ``trained``: the reward of each step's trained samples
    (``steps.jsonl``) over a trailing ``window`` of steps; ``eval``: the held-out eval set's rounds
    (``eval.jsonl``), each at the wall time of the step whose weights it evaluated, unsmoothed
    (a round already averages the whole eval set)."""
    window = window if source == "trained" else 1
    out: dict[str, Any] = {"level": level, "window": window, "source": source, "variants": {}}
    for v, dirs in run_dirs.items():
        seeds = []
        for d in dirs:
            rows = _jsonl(d / "steps.jsonl")
            walls, rewards = reward_curve(rows) if source == "trained" else eval_curve(rows, _jsonl(d / "eval.jsonl"))
            smooth = [m for m in trailing_mean(rewards, window) if m is not None] if rewards else []
            seeds.append({"run": d.name, "wall_s": walls, "reward": rewards,
                          "time_to_reward_s": time_to_reward(walls, rewards, level, window),
                          "final_reward": smooth[-1] if smooth else None})
        times = [s["time_to_reward_s"] for s in seeds if s["time_to_reward_s"] is not None]
        out["variants"][v] = {"seeds": seeds, "reached": len(times), "runs": len(seeds),
                              "time_to_reward_median_s": statistics.median(times) if times else None,
                              "final_reward_mean": _mean([s["final_reward"] for s in seeds])}
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def markdown_table(agg: dict[str, Any]) -> str:
    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    base = agg["ratios"].get("sync_baseline")
    base_thr = agg["means"][base]["throughput_median"] if base else None
    lines = ["| variant | throughput (tok/s), median (min-max) | spread | efficiency, median (min-max) | vs sync | "
             "step time (s) | rollout-only | utilization | reward first -> last | max staleness |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v, m in agg["means"].items():
        med = m["throughput_median"]
        spread = (m["throughput_max"] - m["throughput_min"]) / med if med else None
        lines.append(
            f"| {v} | {f(med, '{:.0f}')} ({f(m['throughput_min'], '{:.0f}')}-{f(m['throughput_max'], '{:.0f}')}) | "
            f"{f(spread, '{:.0%}')} | {f(m['efficiency'])} ({f(m['efficiency_min'])}-{f(m['efficiency_max'])}) | "
            f"{f(med / base_thr if med and base_thr else None)} | {f(m['step_time_median'])} | "
            f"{f(m['rollout_only_fraction'])} | {f(m['rollout_utilization'])} | "
            f"{f(m['reward_first'], '{:.3f}')} -> {f(m['reward_last'], '{:.3f}')} | {f(m['max_consumed_staleness'], '{:.0f}')} |")
    lim = agg.get("limits")
    limit_lines = []
    if lim:
        limit_lines = ["", "Limits (prompt+response tokens/s, median (min-max) over the rounds): rollout alone "
                       f"{f(lim['rollout_tokens_per_s'], '{:.0f}')} ({f(lim['rollout_min'], '{:.0f}')}-{f(lim['rollout_max'], '{:.0f}')}), "
                       f"training alone {f(lim['training_tokens_per_s'], '{:.0f}')} ({f(lim['training_min'], '{:.0f}')}-{f(lim['training_max'], '{:.0f}')}), "
                       f"bound min(the two) {f(lim['bound_tokens_per_s'], '{:.0f}')} ({lim['bound_by']}-bound)."]
    ratio_lines = [f"- `{k}`: {v:.2f}x" for k, v in agg["ratios"].items() if isinstance(v, float)]
    ci_lines = []
    if agg.get("ratio_ci"):
        level = next(iter(agg["ratio_ci"].values()))["level"]
        ci_lines = ["", f"Ratios paired by round (geometric mean of the rounds' throughput ratios, {level:.0%} t interval):"]
        ci_lines += [f"- `{k}`: {c['ratio']:.2f}x ({f(c['lo'])}-{f(c['hi'])}, {c['pairs']} rounds)"
                     f"{' above 1' if c['above_one'] else ''}" for k, c in agg["ratio_ci"].items()]
    if agg.get("bound_exceeded"):
        ci_lines += ["", "Runs above their round's bound: " + ", ".join(agg["bound_exceeded"]) + "."]
    return "\n".join(lines + limit_lines + ["", f"Sync baseline: `{base}`.", ""] + ratio_lines + ci_lines) + "\n"


def learning_table(learn: dict[str, Any]) -> str:
    """Time-to-reward per variant: the seeds' times (wall seconds; '-': not reached) and final rewards."""
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    what = (f"a trailing {learn['window']}-step mean reward of {learn['level']:.3f} (the trained samples"
            if learn.get("source", "trained") == "trained" else
            f"a mean reward of {learn['level']:.3f} on the held-out eval set (the weights of each eval round's step")
    lines = [f"Time to {what}; wall seconds of the steps; '-': not reached in the run):", "",
             "| variant | reached | median (s) | per seed (s) | final trailing reward, per seed |", "|---|---|---|---|---|"]
    for v, m in learn["variants"].items():
        lines.append(f"| {v} | {m['reached']}/{m['runs']} | {f(m['time_to_reward_median_s'])} | "
                     f"{' / '.join(f(s['time_to_reward_s']) for s in m['seeds'])} | "
                     f"{' / '.join(f(s['final_reward'], '{:.3f}') for s in m['seeds'])} |")
    return "\n".join(lines) + "\n"


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def seed_mean_curves(dirs: list[Path]) -> tuple[list[int], list[float], list[float]]:
    """Steps, reward per step averaged over the seeds' runs, and mean cumulative step time per step."""
    per_run = []
    for d in dirs:
        path = d / "steps.jsonl"
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            per_run.append({r["step"]: r for r in rows})
    if not per_run:
        return [], [], []
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    rewards = [statistics.fmean(r[s].get("reward/mean", 0.0) for r in per_run) for s in steps]
    walls, t = [], [0.0] * len(per_run)
    for s in steps:
        for k, r in enumerate(per_run):
            t[k] += r[s].get("perf/step_time_s", 0.0)
        walls.append(statistics.fmean(t))
    return steps, rewards, walls


def plot_rewards(run_dirs: dict[str, list[Path]], out: Path, window: int = 5) -> Path:
    """Reward per step and per wall second, one line per variant: mean over seeds, then a
    ``window``-step moving average (single steps of a few groups are too noisy to compare)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, dirs in run_dirs.items():
        steps, rewards, walls = seed_mean_curves(dirs)
        if not steps:
            continue
        smooth = _smooth(rewards, window)
        line, = ax1.plot(steps, smooth, label=f"{variant} ({len(dirs)} seeds)", alpha=0.85)
        ax2.plot(walls, smooth, color=line.get_color(), alpha=0.85)
    ax1.set_xlabel("training step")
    ax1.set_ylabel(f"mean reward ({window}-step moving average)")
    ax2.set_xlabel("wall seconds (training steps only)")
    ax1.legend(fontsize="small")
    ax1.set_title("reward per step")
    ax2.set_title("reward per wall second")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_reward_curves(learn: dict[str, Any], out: Path) -> Path:
    """Reward of the trained samples against wall seconds, one panel per variant, one line per seed
    (its trailing mean, the raw steps faint), the level of time-to-reward as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = learn["variants"]
    fig, axes = plt.subplots(1, max(1, len(variants)), figsize=(4.2 * max(1, len(variants)), 3.8),
                             sharey=True, squeeze=False)
    for ax, (v, m) in zip(axes[0], variants.items()):
        for s in m["seeds"]:
            line, = ax.plot(s["wall_s"], trailing_mean(s["reward"], learn["window"]), label=s["run"])
            ax.plot(s["wall_s"], s["reward"], color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.axhline(learn["level"], color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{v}: {m['reached']}/{m['runs']} reach {learn['level']:.2f}", fontsize="medium")
        ax.set_xlabel("wall seconds (steps)")
        ax.legend(fontsize="x-small")
    axes[0][0].set_ylabel(f"reward ({learn['window']}-step trailing mean)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_overviews(run_dirs: dict[str, list[Path]], out: Path, columns: int = 2) -> Path | None:
    """``overview.png`` of DIR: each variant's run overview (its first seed's ``RUN_DIR/overview.png``,
    drawn from its ``steps.jsonl`` when the run wrote none) side by side, ``columns`` to a row, so
    the modes' learning, throughput, trainer wait, staleness and weight-sync cost can be compared
    on one screen. None when no run has a step to draw."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from dora_megatron.observability.overview import write_run_overview

    images: dict[str, Path] = {}
    for variant, dirs in run_dirs.items():
        if not dirs:
            continue
        path = dirs[0] / "overview.png"
        if not path.is_file():
            path = write_run_overview(dirs[0], title=f"{variant}: run overview ({dirs[0].name})")
        if path is not None:
            images[variant] = path
    if not images:
        return None
    columns = max(1, min(columns, len(images)))
    n_rows = math.ceil(len(images) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(9 * columns, 4.6 * n_rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, (variant, path) in zip(axes.ravel(), images.items()):
        ax.imshow(mpimg.imread(path), interpolation="antialiased")
        ax.set_title(variant, fontsize="large", fontweight="bold")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_bench(cfg: DoraConfig, out_dir: str | Path, say=log.info) -> dict[str, Any]:
    from dora_megatron.launch.local import prepare_model, run_local_job

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(cfg, out, say=say)  # one model (warm-started once) for every variant
    n_cores = len(os.sched_getaffinity(0))
    runs: dict[str, list[dict[str, Any]]] = {}
    run_dirs: dict[str, list[Path]] = {}
    limits: list[dict[str, Any]] = []
    for k, name in run_order(cfg.bench.variants, cfg.bench.seeds, cfg.bench.limits):
        run_dir = out / "runs" / f"{name}-seed{k}"
        if name == LIMITS:
            from dora_megatron.launch.capacity import measure_capacities

            # the async variants' placement: engines on their cores, the trainer on its own
            lcfg = variant_config(cfg, "sync", k, run_dir, model_dir, n_cores)
            say(f"bench: limits (round {k}) -> {run_dir}")
            try:
                lim = measure_capacities(lcfg, run_dir, model_dir, cfg.bench.limit_steps, say=say)
            except Exception as err:  # noqa: BLE001 - a child that died, a timeout: name where the logs are
                raise RuntimeError(f"bench limits round {k} failed: {err}; logs in {run_dir / 'logs'}") from err
            limits.append(lim)
            (run_dir / "limits.json").write_text(json.dumps(lim, indent=2) + "\n")  # kept if a later run fails
            say(f"bench: limits round {k}: rollout alone {lim['rollout_tokens_per_s'] or 0:.0f} tok/s, "
                f"training alone {lim['training_tokens_per_s'] or 0:.0f} tok/s")
            continue
        vcfg = variant_config(cfg, name, k, run_dir, model_dir, n_cores)
        say(f"bench: {name} (seed {k}) -> {run_dir}")
        rc = run_local_job(vcfg)
        if rc != 0:
            raise RuntimeError(f"bench variant {name} seed {k} failed with status {rc}; logs in {run_dir / 'logs'}")
        summary = json.loads((run_dir / "summary.json").read_text())
        runs.setdefault(name, []).append(summary)
        run_dirs.setdefault(name, []).append(run_dir)
        say(f"bench: {name} seed {k}: {summary['throughput_tokens_per_s']:.0f} tok/s, "
            f"step {summary['mean_step_time_s']:.2f} s, rollout-only {summary['rollout_only_fraction']:.2f}")
    return write_results(cfg, out, runs, run_dirs, limits, n_cores, say)


def write_results(cfg: DoraConfig, out: Path, runs: dict[str, list[dict[str, Any]]], run_dirs: dict[str, list[Path]],
                  limits: list[dict[str, Any]], n_cores: int, say=log.info) -> dict[str, Any]:
    """``bench.json``, ``bench.md`` and the figures of DIR from the runs' summaries and directories
    (also usable on a finished bench directory to aggregate it again)."""
    b = cfg.bench
    agg = aggregate(runs, b.baseline, limits or None, b.ci_level)
    learn = learning(run_dirs, b.reward_level, b.reward_window, b.reward_source)
    result = {"runs": runs, **agg, "learning": learn, "cores": n_cores,
              "order": [f"{n}-seed{k}" for k, n in run_order(b.variants, b.seeds, b.limits)]}
    table = markdown_table(agg) + "\n" + learning_table(learn)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(table)
    plot_rewards(run_dirs, out / "reward.png")
    plot_reward_curves(learn, out / "reward_curves.png")
    plot_overviews(run_dirs, out / "overview.png")
    say("\n" + table)
    return result
