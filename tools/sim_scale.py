#!/usr/bin/env python3
"""Scale run: dora with a MoE-like cost model on thousands of accelerators (EP groups as instances).

WHY: the orchestrator must decide in milliseconds even with thousands of instances and tens of
thousands of in-flight requests; this measures its own wall time (per rebalance, per simulated
step) and the simulator's, and prints a markdown table.

    python tools/sim_scale.py [--configs configs/sim/moe_scale_4k.yaml ...] [--steps N] [--set a.b=c ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT = [ROOT / "configs/sim/moe_scale_4k.yaml", ROOT / "configs/sim/moe_scale_16k.yaml"]


def main(argv: list[str] | None = None) -> int:
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.engine import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=[str(p) for p in DEFAULT])
    ap.add_argument("--steps", type=int, default=None, help="override sim.steps")
    ap.add_argument("--mode", default="dora")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for path in args.configs:
        sets = list(args.overrides) + ([f"sim.steps={args.steps}"] if args.steps else [])
        if args.steps:
            sets.append(f"sim.warmup_steps={min(2, args.steps - 1)}")
        cfg = load_sim_config(path, sets, mode=args.mode)
        t = time.perf_counter()
        res = simulate(cfg)
        wall = time.perf_counter() - t
        s, x = res.summary, res.extra
        row = {
            "config": Path(path).name, "accelerators": cfg.cluster.total_gpus,
            "instances": x["rollout_instances"], "steps": s["steps"], "tbs": s["tbs"],
            "samples_per_step": s["tbs"] * cfg.orchestrator_config().group_size,
            "sim_wall_s": wall, "sim_wall_s_per_step": wall / max(1, s["steps"]),
            "orch_wall_s": x["orchestrator_wall_s"], "orch_wall_s_per_step": x["orchestrator_wall_s_per_step"],
            "orch_calls": x["orchestrator_calls"], "rebalances": x["orchestrator_rebalances"],
            "orch_wall_ms_per_rebalance": (x["orchestrator_wall_s_per_rebalance"] or 0) * 1000,
            "orch_max_call_ms": x["orchestrator_max_call_s"] * 1000,
            "throughput_tokens_per_s": s["throughput_tokens_per_s"], "rollout_only_fraction": s["rollout_only_fraction"],
            "rollout_utilization": s["rollout_utilization"], "staleness_histogram": s["staleness_histogram"],
            "c1": s["c1_violations"], "c3": s["c3_violations"], "lost": s["lost_groups"], "dup": s["duplicated_groups"],
            # the simulator's own check of every batch, beside the orchestrator's counts
            "sim_c3": x["sim_checks"]["c3_violations"], "sim_lost": x["sim_checks"]["lost_groups"],
            "deadlock": x["deadlock"],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    cols = ["config", "accelerators", "instances", "steps", "samples_per_step", "sim_wall_s_per_step",
            "orch_wall_s_per_step", "orch_wall_ms_per_rebalance", "orch_max_call_ms", "rebalances",
            "throughput_tokens_per_s", "rollout_only_fraction", "rollout_utilization", "c1", "c3", "lost", "dup", "sim_c3", "sim_lost"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
