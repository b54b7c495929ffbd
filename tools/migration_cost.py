#!/usr/bin/env python
"""What a finished run's request migrations cost and what they freed, per training step.

    python tools/migration_cost.py RUN_DIR [RUN_DIR ...]

Reads ``summary.json`` and the timeline (``trace.json``, written with ``observability.timeline:
true``, as the main job does) of each run directory and prints one JSON object per run:

- ``migrations_per_step`` (ordered by the orchestrator) and ``kv_moves_per_step`` (carried out:
  the rest had finished before their export);
- ``stall_request_s_per_step``: request-seconds a moved request made no progress while it left its
  source (the summary's ``migration_stall_s``; from the timeline's ``migrate-in`` spans when the
  summary predates that field);
- ``freed_slot_s_per_step``: request-slot-seconds the moved requests then ran at their destination
  (``migration_freed_slot_s``): how long they would otherwise have held their source's slots;
- ``freed_instance_s_per_step``: for each burst of moves off one instance that the instance
  followed with a weight load within 0.3 s (a rebalance freeing it for another version), from
  the end of the burst to the end of the last moved request: how much earlier that instance could
  serve its new version; ``freed_loads_s_per_step``: the weight loads those freed instances paid;
- ``moved_above_running_limit_per_step``: moved requests that found their destination already
  running ``rollout.max_running`` requests (from the run's ``config.yaml``), so that they waited
  there for a slot instead of decoding: the part of the freed slot time that was not freed.

WHY a tool and not only summary fields: the freed *instance* time needs the per-instance timeline
(which instance a burst left, and whether it switched right after), which the summary does not keep.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BURST_GAP_US = 50_000  # moves into one instance less than 50 ms apart belong to one rebalance
SWITCH_AFTER_US = 300_000  # a source that loads weights within 0.3 s of the burst was freed by it


def bursts_of(moves: list[dict]) -> list[list[dict]]:
    """Timeline ``migrate-in`` spans grouped into bursts: one destination, consecutive, close in time."""
    out: list[list[dict]] = []
    for m in sorted(moves, key=lambda e: e["ts"]):
        if out and m["tid"] == out[-1][-1]["tid"] and m["ts"] - out[-1][-1]["ts"] < BURST_GAP_US:
            out[-1].append(m)
        else:
            out.append([m])
    return out


def migration_cost(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    import yaml

    limit = int((yaml.safe_load((run_dir / "config.yaml").read_text()).get("rollout") or {}).get("max_running", 0))
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    engines = {tid for tid, name in tracks.items() if name != "trainer"}
    moves = [e for e in events if e.get("cat") == "migration"]
    loads = sorted((e for e in events if e.get("cat") == "weight_sync"), key=lambda e: e["ts"])
    requests = [e for e in events if e.get("cat") == "request"]
    ends = {e["name"]: e["ts"] + e["dur"] for e in requests}
    freed_s = load_s = 0.0
    freed_bursts = above = 0
    for burst in bursts_of(moves):
        t, dst = burst[0]["ts"], burst[0]["tid"]
        moved = {m["name"].split(" ", 1)[1] for m in burst}
        running = sum(1 for r in requests if r["tid"] == dst and r["ts"] < t <= r["ts"] + r["dur"] and r["name"] not in moved)
        if limit:
            above += max(0, running + len(burst) - max(limit, running))
        if len(engines) != 2:
            break  # the source of a move is not on the timeline; with two engines it is the other one
        src = next(t for t in engines if t != burst[0]["tid"])
        left = max(m["ts"] + m["dur"] for m in burst)
        nxt = next((ld for ld in loads if ld["tid"] == src and ld["ts"] >= burst[0]["ts"]), None)
        if nxt is None or nxt["ts"] - left > SWITCH_AFTER_US:
            continue
        last = max((ends[m["name"].split(" ", 1)[1]] for m in burst if m["name"].split(" ", 1)[1] in ends), default=left)
        freed_s += max(0.0, last - left) / 1e6
        load_s += nxt["dur"] / 1e6
        freed_bursts += 1
    steps = summary["steps"] or 1
    stall = summary.get("migration_stall_s")
    if stall is None:
        stall = sum(m["dur"] for m in moves) / 1e6
    freed_slot = summary.get("migration_freed_slot_s")
    if freed_slot is None:
        freed_slot = sum(max(0.0, ends[m["name"].split(" ", 1)[1]] - m["ts"] - m["dur"])
                         for m in moves if m["name"].split(" ", 1)[1] in ends) / 1e6
    return {
        "run_dir": str(run_dir),
        "steps": steps,
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
        "trainer_waiting_fraction": summary["rollout_only_fraction"],
        "migrations_per_step": summary["migrations"] / steps,
        "kv_moves_per_step": len(moves) / steps,
        "stall_request_s_per_step": stall / steps,
        "freed_slot_s_per_step": freed_slot / steps,
        "rebalance_bursts_per_step": freed_bursts / steps,
        "freed_instance_s_per_step": freed_s / steps,
        "freed_loads_s_per_step": load_s / steps,
        "moved_above_running_limit_per_step": above / steps if limit else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, help="finished run directories (summary.json, trace.json)")
    args = ap.parse_args(argv)
    for d in args.run_dirs:
        missing = [f for f in ("summary.json", "trace.json") if not (d / f).is_file()]
        if missing:
            sys.stderr.write(f"{d}: no {' or '.join(missing)} (a finished run with observability.timeline: true)\n")
            return 2
        sys.stdout.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                     for k, v in migration_cost(d).items()}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
