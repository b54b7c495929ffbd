"""``dora simulate``: run the production orchestrator against simulated instances on a virtual clock.

WHY a CLI: the simulator is how a user sizes a cluster and picks S/RBS before spending GPU hours,
and how the project checks that its policy reproduces the paper's numbers. One run writes the
DESIGN section 11 summary (plus per-step series) to ``--out``, the per-step metrics next to it
(``<stem>_steps.jsonl``, one row per step with the keys of ``dora train``'s steps.jsonl) and
PNGs (steps, timeline, and ``<stem>_overview.png``, the run overview ``dora train`` draws); ``--mode all`` runs every mode on the same workload and writes ``{"modes": {...},
"comparison": ...}`` and ``<stem>_steps_<mode>.jsonl`` per mode.
"""

from __future__ import annotations

import argparse
import sys

HELP = "Run the orchestrator against simulated instances on a virtual clock (writes summary JSON + PNGs)."
MODES = ("sync", "one_step_off", "partial", "dora")
#: what ``--mode`` takes: the orchestrator's modes, dora with elastic colocation, and every one of them
CHOICES = MODES + ("dora_elastic", "all")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="sim YAML (see configs/sim/)")
    # choices: a wrong --mode is refused by its flag name with every valid value (not later, as the
    # config's orchestrator.mode, which knows neither dora_elastic nor all)
    parser.add_argument("--mode", default=None, choices=CHOICES,
                        help=f"{' | '.join(CHOICES)} (default: orchestrator.mode)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="override a config value (repeatable), e.g. --set orchestrator.max_staleness=2")
    parser.add_argument("--out", required=True, help="result JSON path (PNG plots are written next to it)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run_modes(config: str, modes: list[str], overrides: list[str]) -> dict[str, dict]:
    """Run each mode (``dora_elastic`` = dora with ``cluster.elastic_colocation=true``)."""
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.bound import bound_report
    from dora_megatron.sim.engine import simulate

    out = {}
    for m in modes:
        extra = list(overrides)
        mode = m
        if m == "dora_elastic":
            mode, extra = "dora", extra + ["cluster.elastic_colocation=true"]
        cfg = load_sim_config(config, extra, mode=mode)
        res = simulate(cfg)
        d = res.to_json()
        d["timeline"] = res.timeline
        # --- the deployment's physical bound (sim/bound.py) and how close this mode gets
        d["bound"] = bound_report(cfg, d.get("throughput_tokens_per_s"))
        d["efficiency"] = d["bound"]["efficiency"]
        d["step_rows"] = res.steps
        out[m] = d
    return out


def comparison(results: dict[str, dict]) -> dict[str, dict]:
    """Throughput and step-time ratios of every mode against sync and partial."""
    comp: dict[str, dict] = {}
    for base in ("sync", "partial"):
        b = results.get(base)
        if not b or not b.get("throughput_tokens_per_s"):
            continue
        for m, r in results.items():
            if r.get("throughput_tokens_per_s") is None:
                continue
            comp.setdefault(m, {})[f"throughput_vs_{base}"] = r["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
            if r.get("mean_step_time_s") and b.get("mean_step_time_s"):
                comp[m][f"step_time_speedup_vs_{base}"] = b["mean_step_time_s"] / r["mean_step_time_s"]
    return comp


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    from pathlib import Path

    from dora_megatron.config.base import ConfigError

    log = logging.getLogger("dora.simulate")
    modes = list(MODES) + ["dora_elastic"] if args.mode == "all" else [args.mode] if args.mode else [None]
    try:
        if modes == [None]:
            from dora_megatron.config.sim import load_sim_config

            modes = [load_sim_config(args.config, args.overrides).orchestrator_config().mode]
        results = run_modes(args.config, modes, args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"config error: {err}\n")
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    timelines = {m: r.pop("timeline") for m, r in results.items()}
    steps = {m: r.pop("step_rows") for m, r in results.items()}
    if len(results) == 1:
        payload = next(iter(results.values()))
    else:
        payload = {"modes": results, "comparison": comparison(results)}
    out.write_text(json.dumps(payload, indent=1))
    stem = out.with_suffix("")
    for m, rows in steps.items():  # the per-step rows, the same keys as dora train's steps.jsonl
        path = Path(f"{stem}_steps.jsonl") if len(steps) == 1 else Path(f"{stem}_steps_{m}.jsonl")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if not args.no_plots:
        from dora_megatron.sim.plots import plot_steps, timeline_intervals

        from dora_megatron.observability.timeline_plot import draw_timeline

        from dora_megatron.observability.overview import write_overview

        plot_steps(results, f"{stem}_steps.png")
        for m, rows in steps.items():  # the overview dora train writes, from the same rows
            if rows:
                write_overview(Path(f"{stem}_overview.png") if len(steps) == 1 else Path(f"{stem}_overview_{m}.png"),
                               rows, results[m], title=f"{m} (simulated): run overview")
        for m, tl in timelines.items():
            if not tl:  # sim.timeline: false records none: no blank image
                continue
            draw_timeline(timeline_intervals(tl, steps[m]), f"{stem}_timeline_{m}.png", title=f"{m} (simulated)")
    for m, r in results.items():
        thr = r["throughput_tokens_per_s"]
        step = r["mean_step_time_s"]
        print(f"{m:>13}: throughput {thr if thr is None else round(thr):>8} tok/s, step "
              f"{'n/a' if step is None else f'{step:.1f}':>8} s, rollout-only {r['rollout_only_fraction'] or 0:.3f}, "
              f"util {r['rollout_utilization'] or 0:.3f}, bound {r['bound']['bound_tokens_per_s']:.0f} tok/s "
              f"({r['bound']['binding']}), efficiency {r['efficiency'] or 0:.3f}, staleness {r['staleness_histogram']}")
    log.info("wrote %s", out)
    return 0
