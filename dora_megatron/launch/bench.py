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
    # S=3 without KV migration (what an engine without it, SGLang, does): its pair is dora_s3
    "dora_s3_reprefill": {"orchestrator.mode": "dora", "orchestrator.max_staleness": 3, "controller.migration": "reprefill"},
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


#: Ablation -> its reference: the same variant with KV migration (the re-prefill cost is their difference).
REPREFILL_PAIRS = {"dora_reprefill": "dora", "dora_s3_reprefill": "dora_s3"}


def run_name(variant: str, engine: str | None) -> str:
    """``VARIANT@ENGINE`` when ``bench.engines`` lists engines, else the variant's name."""
    return f"{variant}@{engine}" if engine else variant


def split_name(name: str) -> tuple[str, str | None]:
    """The inverse of :func:`run_name`."""
    variant, _, engine = name.partition("@")
    return variant, engine or None


def variant_config(base: DoraConfig, name: str, seed_index: int, run_dir: Path, model_dir: Path, n_cores: int) -> DoraConfig:
    """The config of one run: ``name`` is a variant, or ``VARIANT@ENGINE`` (:func:`run_name`) to
    run it on that rollout engine, started by the train job's own launcher."""
    name, engine = split_name(name)
    spec = dict(VARIANTS[name])
    if engine:
        spec["rollout.engine"] = engine
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


def run_order(variants: list[str], seeds: int, limits: bool, engines: list[str] | None = None) -> list[tuple[int, str]]:
    """``(seed index, run name)`` in run order, seed-major: round k runs the limits (when measured)
    and then every variant's seed k, before any seed k+1. With ``engines``, each engine's limits and
    variants (:func:`run_name`) in turn within the round, so load drift is shared by the engines too;
    a variant listed as ``VARIANT@ENGINE`` runs on that engine only."""
    head = [LIMITS] if limits else []
    return [(k, run_name(v, ve or e)) for k in range(seeds) for e in (engines or [None])
            for v, ve in map(split_name, head + list(variants)) if not (ve and e and ve != e)]


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


def _throughputs(rs: list[dict[str, Any]]) -> list[float | None]:
    return [r.get("throughput_tokens_per_s") for r in rs]


def engine_runs(runs: dict[str, list[dict[str, Any]]], engine: str) -> dict[str, list[dict[str, Any]]]:
    """The runs of one engine (``VARIANT@ENGINE``), keyed by variant."""
    return {split_name(n)[0]: rs for n, rs in runs.items() if split_name(n)[1] == engine}


def aggregate_engines(runs: dict[str, list[dict[str, Any]]], engines: list[str], baseline: str,
                      limits: dict[str | None, list[dict[str, Any]]], ci_level: float) -> dict[str, Any]:
    """``bench.engines``: :func:`aggregate` of each engine's runs on their own (its own sync
    baseline and ratios, its own limits), and ``engine_ratio_ci``: each variant's throughput on
    every other engine over its throughput on the first listed, paired by round."""
    out: dict[str, Any] = {"engines": {e: aggregate(engine_runs(runs, e), baseline, limits.get(e) or None, ci_level)
                                       for e in engines}}
    cross: dict[str, Any] = {}
    for name, rs in runs.items():
        variant, engine = split_name(name)
        ref = run_name(variant, engines[0])
        if engine == engines[0] or ref not in runs:
            continue
        ci = paired_ratio_ci(_throughputs(rs), _throughputs(runs[ref]), ci_level)
        if ci is not None:
            cross[f"{name}/{ref}_throughput"] = ci.to_json()
    out["engine_ratio_ci"] = cross
    return out


def engines_markdown(agg: dict[str, Any]) -> str:
    """One :func:`markdown_table` per engine, then the paired engine-vs-engine ratios."""
    parts = [f"### Engine `{e}`\n\n" + markdown_table(a) for e, a in agg["engines"].items()]
    cis = agg["engine_ratio_ci"]
    if cis:
        level = next(iter(cis.values()))["level"]
        parts.append(f"Engine against engine, the same variant (geometric mean of the rounds' throughput ratios, "
                     f"{level:.0%} t interval):\n\n" + "\n".join(_ci_line(k, c) for k, c in cis.items()) + "\n")
    return "\n".join(parts)


def _fmt(x: float | None, fmt: str = "{:.2f}", missing: str = "n/a") -> str:
    """A table cell: ``x`` formatted, or ``missing`` when there is no value."""
    return missing if x is None else fmt.format(x)


def _ci_line(key: str, c: dict[str, Any]) -> str:
    return f"- `{key}`: {c['ratio']:.2f}x ({_fmt(c['lo'])}-{_fmt(c['hi'])}, {c['pairs']} rounds)"


def reprefill_costs(runs: dict[str, list[dict[str, Any]]], ci_level: float = 0.95) -> dict[str, Any]:
    """What moves by abort + resubmit cost, per run name with migrations (means over its seeds):
    the migrations, those that fell back to resubmit (``migrations_reprefill``: SGLang and vLLM
    always, the embedded engine under ``controller.migration: reprefill``), the prompt + partial
    tokens they re-prefilled, the seconds the moved requests made no progress while leaving their
    source (``migration_stall_s``), and, for an ablation of :data:`REPREFILL_PAIRS` whose KV
    reference ran on the same engine, the time re-prefill costs: the median step time over the
    reference's (``step_time_cost_s``) and the throughput ratio paired by round (``vs_kv``)."""
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        migrations = [r.get("migrations") for r in rs]
        if not any(migrations):
            continue
        fallbacks = sum(r.get("migrations_reprefill") or 0 for r in rs)
        tokens = sum(r.get("reprefill_tokens") or 0 for r in rs)
        row = {"migrations": _mean(migrations), "migrations_reprefill": fallbacks / len(rs),
               "reprefill_tokens": tokens / len(rs), "tokens_per_reprefill": tokens / fallbacks if fallbacks else None,
               "migration_stall_s": _mean([r.get("migration_stall_s") for r in rs]),
               "step_time_cost_s": None, "vs_kv": None, "kv_reference": None}
        variant, engine = split_name(name)
        ref = run_name(REPREFILL_PAIRS.get(variant, ""), engine)
        if variant in REPREFILL_PAIRS and ref in runs:
            row["kv_reference"] = ref
            mine, theirs = (median_spread([r.get("mean_step_time_s") for r in x])[0] for x in (rs, runs[ref]))
            row["step_time_cost_s"] = mine - theirs if mine is not None and theirs is not None else None
            ci = paired_ratio_ci(_throughputs(rs), _throughputs(runs[ref]), ci_level)
            row["vs_kv"] = ci.to_json() if ci is not None else None
        out[name] = row
    return out


def reprefill_table(costs: dict[str, Any]) -> str:
    """The table of :func:`reprefill_costs` (empty when no run migrated)."""
    if not costs:
        return ""
    f = _fmt
    lines = ["Migrations and what abort + resubmit cost (means per run; the time against the same variant with "
             "KV migration on the same engine):", "",
             "| run | migrations | by resubmit | re-prefilled tokens | tokens per resubmit | stall (s) | "
             "step time cost vs KV (s) | throughput vs KV |", "|---|---|---|---|---|---|---|---|"]
    for name, c in costs.items():
        ratio = "n/a" if c["vs_kv"] is None else _ci_line(c["kv_reference"], c["vs_kv"])[2:]
        lines.append(f"| {name} | {f(c['migrations'], '{:.1f}')} | {f(c['migrations_reprefill'], '{:.1f}')} | "
                     f"{f(c['reprefill_tokens'], '{:.0f}')} | {f(c['tokens_per_reprefill'], '{:.0f}')} | "
                     f"{f(c['migration_stall_s'])} | {f(c['step_time_cost_s'])} | {ratio} |")
    return "\n".join(lines) + "\n"


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
    f = _fmt
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
        return _fmt(x, fmt, "-")

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
    limits: dict[str | None, list[dict[str, Any]]] = {}  # engine (None: as configured) -> one per round
    for k, name in run_order(cfg.bench.variants, cfg.bench.seeds, cfg.bench.limits, cfg.bench.engines):
        run_dir = out / "runs" / f"{name}-seed{k}"
        variant, engine = split_name(name)
        if variant == LIMITS:
            from dora_megatron.launch.capacity import measure_capacities

            # the async variants' placement: engines on their cores, the trainer on its own
            lcfg = variant_config(cfg, run_name("sync", engine), k, run_dir, model_dir, n_cores)
            say(f"bench: limits (round {k}) -> {run_dir}")
            try:
                lim = measure_capacities(lcfg, run_dir, model_dir, cfg.bench.limit_steps, say=say)
            except Exception as err:  # noqa: BLE001 - a child that died, a timeout: name where the logs are
                raise RuntimeError(f"bench limits round {k} failed: {err}; logs in {run_dir / 'logs'}") from err
            limits.setdefault(engine, []).append(lim)
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
                  limits: dict[str | None, list[dict[str, Any]]], n_cores: int, say=log.info) -> dict[str, Any]:
    """``bench.json``, ``bench.md`` and the figures of DIR from the runs' summaries and directories
    (also usable on a finished bench directory to aggregate it again). ``limits``: per engine
    (``bench.engines``; None: the configured engine), one per round."""
    b = cfg.bench
    if b.engines:
        agg = aggregate_engines(runs, b.engines, b.baseline, limits, b.ci_level)
        table = engines_markdown(agg)
    else:
        agg = aggregate(runs, b.baseline, limits.get(None) or None, b.ci_level)
        table = markdown_table(agg)
    agg["reprefill"] = reprefill_costs(runs, b.ci_level)
    learn = learning(run_dirs, b.reward_level, b.reward_window, b.reward_source)
    result = {"runs": runs, **agg, "learning": learn, "cores": n_cores,
              "order": [f"{n}-seed{k}" for k, n in run_order(b.variants, b.seeds, b.limits, b.engines)]}
    table += "\n" + reprefill_table(agg["reprefill"]) + "\n" + learning_table(learn)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(table)
    plot_rewards(run_dirs, out / "reward.png")
    plot_reward_curves(learn, out / "reward_curves.png")
    plot_overviews(run_dirs, out / "overview.png")
    say("\n" + table)
    return result
