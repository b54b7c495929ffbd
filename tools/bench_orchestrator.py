#!/usr/bin/env python
"""Benchmark the DORA rebalancer at production scale: 4,096 instances, ~100,000 in-flight requests.

WHY: the orchestrator decides on the critical path of every weight update; the issue requires a
rebalance over 4,096 instances and 100,000 in-flight requests in well under 100 ms of Python.
This builds such a state through the public event API (several versions live, long tails on old
versions), then times (a) the update-driven rebalance inside ``on_step_finished`` and (b) forced
timer-triggered rebalances (hysteresis off, so the partition/move plan is always computed).

Usage: python tools/bench_orchestrator.py [--instances 4096] [--inflight 100000] [--steps 3] [--budget N]

``--budget`` defaults to ``orchestrator.max_migrations_per_rebalance``'s default (a bare run measures
what a job runs with); ``--budget 0`` times the unbounded rebalance.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dora_megatron.config.orchestrator import OrchestratorConfig  # noqa: E402
from dora_megatron.orchestrator import Migrate, Orchestrator, ReleaseBatch, Submit, SwitchVersion  # noqa: E402
from dora_megatron.orchestrator.rebalance import rebalance  # noqa: E402


def build(n_inst: int, inflight: int, group_size: int, staleness: int, seed: int, budget: int = 0):
    # the window holds (S+1)*TBS groups; one step consumes TBS of them, so size the window so that
    # ~``inflight`` requests are still running when the next version arrives
    groups = -(-inflight * (staleness + 1) // (staleness * group_size))
    tbs = -(-groups // (staleness + 1))
    cap = -(-inflight // n_inst) + 8
    cfg = OrchestratorConfig(mode="dora", tbs=tbs, rbs=groups, max_staleness=staleness, group_size=group_size,
                             cap_before_rebalance=cap, cap_after_rebalance=cap, rebalance_interval_s=0,
                             imbalance_ratio=1.2, max_migrations_per_rebalance=budget)
    ids = [f"inst{i:05d}" for i in range(n_inst)]
    orch = Orchestrator(cfg, ids)
    rng = random.Random(seed)
    state = {"running": {}, "switching": {}, "busy": False}

    def apply(actions):
        for a in actions:
            if isinstance(a, Submit):
                state["running"][a.sample_id] = a.instance
            elif isinstance(a, SwitchVersion):
                state["switching"][a.instance] = a.version
            elif isinstance(a, ReleaseBatch):
                state["busy"] = True

    apply(orch.start())
    return cfg, orch, rng, state, apply


def advance_one_step(orch, rng, state, apply, tail_keep: float):
    """Finish whole random groups (the rest is the long tail, ``tail_keep`` of the groups is never
    picked) until a batch is released, then confirm pending switches. The trainer is left busy."""
    running = state["running"]
    by_group: dict[str, list[str]] = {}
    for sid in running:
        by_group.setdefault(sid.rsplit(".", 1)[0], []).append(sid)
    gids = sorted(by_group)
    rng.shuffle(gids)
    gids = gids[: int(len(gids) * (1 - tail_keep))]
    for gid in gids:
        for sid in by_group[gid]:
            if sid in running:
                del running[sid]
                apply(orch.on_sample_finished(sid))
        if state["busy"]:
            break
    for iid, v in list(state["switching"].items()):
        del state["switching"][iid]
        apply(orch.on_switch_done(iid, v))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4096)
    ap.add_argument("--inflight", type=int, default=100_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="weight updates to time")
    ap.add_argument("--forced", type=int, default=5, help="forced timer rebalances to time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gc", action="store_true",
                    help="disable the cyclic GC during the timed calls (shows its share)")
    # the default is the orchestrator's own, so that a bare run measures what a job runs with
    default_budget = OrchestratorConfig().max_migrations_per_rebalance
    ap.add_argument("--budget", type=int, default=default_budget,
                    help=f"orchestrator.max_migrations_per_rebalance (default: the config default, {default_budget}; "
                         "0 = unlimited)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    cfg, orch, rng, state, apply = build(args.instances, args.inflight, args.group_size, args.staleness, args.seed,
                                        args.budget)
    update_ms, forced_ms, inflight_at = [], [], []
    update_cpu_ms, forced_cpu_ms, update_moves = [], [], []
    for step in range(args.steps):
        advance_one_step(orch, rng, state, apply, tail_keep=0.3)
        n_inflight = sum(orch.unfinished_by_version().values())
        if args.no_gc:
            gc.disable()
        t, c = time.perf_counter(), time.process_time()
        acts = orch.on_step_finished(step + 1)
        update_ms.append((time.perf_counter() - t) * 1e3)
        update_cpu_ms.append((time.process_time() - c) * 1e3)
        gc.enable()
        update_moves.append(sum(1 for a in acts if isinstance(a, Migrate)))
        inflight_at.append(n_inflight)
        state["busy"] = False
        apply(acts)
        for iid, v in list(state["switching"].items()):
            del state["switching"][iid]
            apply(orch.on_switch_done(iid, v))
    # forced rebalances: hysteresis off, every call computes demand, partition and move plan
    orch.config.imbalance_ratio = 1.0
    for k in range(args.forced):
        n_inflight = sum(orch.unfinished_by_version().values())
        if args.no_gc:
            gc.disable()
        t, c = time.perf_counter(), time.process_time()
        rebalance(orch, "timer")  # the step itself, without the surrounding dispatch
        forced_ms.append((time.perf_counter() - t) * 1e3)
        forced_cpu_ms.append((time.process_time() - c) * 1e3)
        gc.enable()
        apply(orch.poll())
        for iid, v in list(state["switching"].items()):
            del state["switching"][iid]
            apply(orch.on_switch_done(iid, v))
    res = {
        "instances": args.instances, "inflight_requests_at_update": inflight_at,
        "update_rebalance_ms": [round(x, 2) for x in update_ms],
        "update_rebalance_cpu_ms": [round(x, 2) for x in update_cpu_ms],
        "update_rebalance_migrations": update_moves,
        "forced_rebalance_ms": [round(x, 2) for x in forced_ms],
        "forced_rebalance_cpu_ms": [round(x, 2) for x in forced_cpu_ms],
        "update_rebalance_ms_max": round(max(update_ms), 2),
        "forced_rebalance_ms_median": round(statistics.median(forced_ms), 2) if forced_ms else None,
        "instances_by_version": {str(k): v for k, v in orch.instances_by_version().items()},
        "migration_budget": args.budget, "migrations": orch.counters.migrations, "setup_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
