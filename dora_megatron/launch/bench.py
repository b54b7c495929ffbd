"""``dora bench``: every rollout mode on the same workload, measured side by side in one run.

Same model (one warm-started directory shared by all variants), same prompts
(``data.seed``), same engines and trainer, same total CPU cores, same number of
training steps. Asynchronous variants run disaggregated (engines pinned to their
cores, the trainer to its own); ``sync`` is measured both disaggregated and
colocated (every phase may use all cores, as the paper's synchronous baseline
does) and the faster of the two is the baseline of the ratios.

Outputs in ``DIR``: ``bench.json`` (each run's summary, means per variant, ratios
dora/sync, dora/one_step_off, dora/partial for throughput and step time),
``bench.md`` (the table), ``reward.png`` (reward per step and per wall second).
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


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def aggregate(runs: dict[str, list[dict[str, Any]]], baseline: str = "auto") -> dict[str, Any]:
    """Per-variant means and the headline ratios."""
    keys = ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction", "rollout_utilization",
            "reward_first", "reward_last", "wall_time_s", "max_consumed_staleness", "migrations", "reprefill_tokens")
    means = {v: {k: _mean([r.get(k) for r in rs]) for k in keys} for v, rs in runs.items()}
    syncs = [v for v in ("sync", "sync_colocated") if v in means and means[v]["throughput_tokens_per_s"]]
    if baseline == "auto":
        base = max(syncs, key=lambda v: means[v]["throughput_tokens_per_s"]) if syncs else None
    else:
        base = baseline if baseline in means else None
    ratios: dict[str, Any] = {"sync_baseline": base}
    for dora in [v for v in means if v.startswith("dora")]:
        for other, label in ((base, "sync"), ("one_step_off", "one_step_off"), ("partial", "partial")):
            if other is None or other not in means:
                continue
            a, b = means[dora], means[other]
            if a["throughput_tokens_per_s"] and b["throughput_tokens_per_s"]:
                ratios[f"{dora}/{label}_throughput"] = a["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
            if a["mean_step_time_s"] and b["mean_step_time_s"]:
                ratios[f"{dora}/{label}_step_time_speedup"] = b["mean_step_time_s"] / a["mean_step_time_s"]
    return {"means": means, "ratios": ratios}


def markdown_table(agg: dict[str, Any]) -> str:
    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = ["| variant | throughput (tok/s) | step time (s) | rollout-only | utilization | reward first -> last | max staleness |",
             "|---|---|---|---|---|---|---|"]
    for v, m in agg["means"].items():
        lines.append(f"| {v} | {f(m['throughput_tokens_per_s'], '{:.0f}')} | {f(m['mean_step_time_s'])} | "
                     f"{f(m['rollout_only_fraction'])} | {f(m['rollout_utilization'])} | "
                     f"{f(m['reward_first'], '{:.3f}')} -> {f(m['reward_last'], '{:.3f}')} | {f(m['max_consumed_staleness'], '{:.0f}')} |")
    ratio_lines = [f"- `{k}`: {v:.2f}x" for k, v in agg["ratios"].items() if isinstance(v, float)]
    base = agg["ratios"].get("sync_baseline")
    return "\n".join(lines + ["", f"Sync baseline: `{base}`.", ""] + ratio_lines) + "\n"


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


def run_bench(cfg: DoraConfig, out_dir: str | Path, say=log.info) -> dict[str, Any]:
    from dora_megatron.launch.local import prepare_model, run_local_job

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(cfg, out, say=say)  # one model (warm-started once) for every variant
    n_cores = len(os.sched_getaffinity(0))
    runs: dict[str, list[dict[str, Any]]] = {}
    run_dirs: dict[str, list[Path]] = {}
    for name in cfg.bench.variants:
        for k in range(cfg.bench.seeds):
            run_dir = out / "runs" / f"{name}-seed{k}"
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
    agg = aggregate(runs, cfg.bench.baseline)
    result = {"runs": runs, **agg, "cores": n_cores}
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_table(agg))
    plot_rewards(run_dirs, out / "reward.png")
    say("\n" + markdown_table(agg))
    return result
