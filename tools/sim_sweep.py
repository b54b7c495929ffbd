#!/usr/bin/env python3
"""Sweep simulator settings and print each mode's throughput against the deployment's bound.

WHY: "how close to the limit" needs the same run to report the throughput, the physical bound of
its deployment (dora_megatron/sim/bound.py) and the ratios to the baselines, for a handful of
variants of one config, in one markdown table whose command is its provenance.

    python tools/sim_sweep.py --config configs/sim/paper_qwen32b_128gpu.yaml \\
        --variant base: --variant rbs2k:orchestrator.rbs=2048 --modes sync partial dora [--jobs 2] \\
        [--set sim.steps=8 ...] [--json out.json]

A variant is ``NAME:key=value,key=value`` (overrides on top of ``--set``). Ratios to sync and
partial use that variant's own baseline runs when it ran them, else those of the first variant
or of ``--baselines`` (so a variant that only changes DORA's deployment, like
``cluster.trainer_gpus``, is compared with the paper's baselines). ``dora_elastic`` is dora with ``cluster.elastic_colocation=true``.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("sync", "one_step_off", "partial", "dora", "dora_elastic")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME:a=b,c=d`` -> (NAME, ["a=b", "c=d"]); a bad one is a usage error (exit 2)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:key=value[,key=value]")
    sets = [s.strip() for s in rest.split(",") if s.strip()]
    for s in sets:
        if "=" not in s:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {s!r} is not key=value")
    return name, sets


def _one(job: tuple[str, str, str, list[str]]) -> tuple[str, str, dict]:
    config, variant, mode, overrides = job
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.bound import bound_report
    from dora_megatron.sim.engine import simulate

    extra, m = list(overrides), mode
    if mode == "dora_elastic":
        m, extra = "dora", extra + ["cluster.elastic_colocation=true"]
    cfg = load_sim_config(config, extra, mode=m)
    res = simulate(cfg)
    s = res.summary
    return variant, mode, {
        "throughput": s["throughput_tokens_per_s"], "step_s": s["mean_step_time_s"],
        "rollout_only": s["rollout_only_fraction"], "utilization": s["rollout_utilization"],
        "bound": bound_report(cfg, s["throughput_tokens_per_s"]), "sim_cpu_s": res.extra["sim_cpu_s"],
        "checks": [s["lost_groups"], s["duplicated_groups"], s["c3_violations"], res.extra["deadlock"]],
        # the simulator's own check of every batch, beside the orchestrator's counts above
        "sim_checks": res.extra["sim_checks"],
    }


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(results: dict[str, dict[str, dict]], order: list[str], fallback: dict[str, dict] | None = None) -> str:
    first = {**(fallback or {}), **results[order[0]]}
    lines = ["| variant | mode | tok/s | bound tok/s (binding) | efficiency | vs sync | vs partial | rollout-only | util |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in order:
        for mode, r in results[v].items():
            ratios = []
            for base in ("sync", "partial"):
                b = results[v].get(base) or first.get(base)
                ok = b and b["throughput"] and r["throughput"]
                ratios.append(f"{r['throughput'] / b['throughput']:.2f}x" if ok else "-")
            bd = r["bound"]
            lines.append(f"| {v} | {mode} | {_f(r['throughput'], ',.0f')} | {bd['bound_tokens_per_s']:,.0f} "
                         f"({bd['binding']}) | {_f(bd['efficiency'], '.3f')} | {ratios[0]} | {ratios[1]} | "
                         f"{_f(r['rollout_only'], '.2f')} | {_f(r['utilization'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--variant", action="append", type=parse_variant, default=None,
                    help="NAME:key=value,... (repeatable; default: one variant 'base' without overrides)")
    ap.add_argument("--modes", nargs="+", default=["sync", "partial", "dora"], choices=list(MODES))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                    help="override applied to every variant and mode")
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--baselines", default=None, metavar="JSON",
                    help="a previous --json of the same config and --set: its first variant's runs are the "
                         "baselines of variants that did not run their own (saves re-running sync/partial)")
    args = ap.parse_args(argv)
    fallback = None
    if args.baselines:
        prev = json.loads(Path(args.baselines).read_text())
        fallback = next(iter(prev.values()))
    variants = args.variant or [("base", [])]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        ap.error(f"--variant names must be unique, got {names}")
    jobs = [(args.config, n, m, args.overrides + sets) for n, sets in variants for m in args.modes]
    results: dict[str, dict[str, dict]] = {n: {} for n in names}
    from dora_megatron.config.base import ConfigError

    def collect(rows) -> None:
        for v, mode, r in rows:
            results[v][mode] = r
            print(f"done {v} {mode}: {_f(r['throughput'], '.0f')} tok/s, efficiency "
                  f"{_f(r['bound']['efficiency'], '.3f')} (sim cpu {r['sim_cpu_s']:.0f}s)", file=sys.stderr, flush=True)

    try:
        if args.jobs <= 1:
            collect(map(_one, jobs))  # in this process: no pickling, one core
        else:
            with ProcessPoolExecutor(max_workers=args.jobs) as ex:
                collect(ex.map(_one, jobs))
    except ConfigError as err:
        sys.stderr.write(f"config error: {err}\n")
        return 2
    for v in names:  # keep the requested mode order
        results[v] = {m: results[v][m] for m in args.modes if m in results[v]}
    print(table(results, names, fallback))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
