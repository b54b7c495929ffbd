"""How long the newest version has no instance in a simulated DORA run, and which versions hold the pool then.

WHY: on a pool of few instances with S = 3 up to four versions are live, and an instance holds one
version's weights, so the newest version can find every instance busy with older ones. Whether
migration can help depends on *which* older versions hold the pool at those moments: if one old
version spreads over two instances, consolidating its requests onto one frees the other (the
rebalancer's partition does that); if each instance holds a *different* old version, no C1-safe
migration exists (a request may only move to an instance of its own version). This tool runs
the production orchestrator in the simulator with a probe on its decision loop and reports:

- ``stranded_fraction``: share of the simulated time during which the newest version had
  admissible groups but no instance serving or loading it;
- ``by_pool``: that time split by the pool's state, each instance as the age (newest - version)
  of the version it holds: ``[1, 2]`` means one instance on the previous version and one two
  versions back (no migration can free either), ``[1, 1]`` one version on both (consolidation can);
- ``idle_slots_stranded``: the request slots (``cap_before_rebalance`` per instance) left empty
  while the newest was stranded, as a share of all slot-time: the most any remedy that gives the
  newest version room during those stretches could put to work; ``idle_slots``: the same at any time.

    python tools/sim_stranding.py --config configs/sim/two_instances.yaml [--set cluster.total_gpus=14]

``--run-dir RUN_DIR`` measures the same on a finished real run (``dora train``, a ``dora bench``
run) from its ``trace.json``: the newest version at a time is the last one the trainer produced;
it is stranded while no engine holds or loads it (the trace does not say whether admission
wanted groups of it then, so this counts every such moment from the first to the last step's end).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dora_megatron.orchestrator import Orchestrator


class _Probe(Orchestrator):
    """The production orchestrator, recording after every decision whether the newest version is
    stranded and the ages of the versions the instances hold (read-only: decisions unchanged)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[tuple[float, tuple[int, ...] | None, float]] = []

    def _fill(self):  # noqa: ANN202 - same contract as the parent
        out = super()._fill()
        served = self.index.served(self.newest)
        pool = None
        if not served and self._admissible_new() > 0:
            pool = tuple(sorted(self.newest - (i.version if i.version is not None else i.target)
                                for i in self.instances.values() if i.alive))
        cap = self.config.cap_before_rebalance
        alive = [i for i in self.instances.values() if i.alive]
        idle = sum(max(0, cap - len(i.samples)) for i in alive) / (cap * len(alive)) if alive else 0.0
        self.trace.append((self.now, pool, idle))
        return out


def stranding(trace: list[tuple[float, tuple[int, ...] | None, float]]) -> dict[str, Any]:
    """Stranded share of the traced span, its split by pool state, and the empty slot-time (share
    of the pool's slots, time-weighted) while stranded and overall, from the probe's trace."""
    trace = sorted(trace, key=lambda r: r[0])
    span = trace[-1][0] - trace[0][0] if len(trace) > 1 else 0.0
    by: dict[str, float] = {}
    idle = idle_stranded = 0.0
    for (t0, pool, empty), (t1, _, _) in zip(trace, trace[1:]):
        idle += empty * (t1 - t0)
        if pool is not None:
            by[str(list(pool))] = by.get(str(list(pool)), 0.0) + t1 - t0
            idle_stranded += empty * (t1 - t0)
    total = sum(by.values())
    return {"stranded_fraction": total / span if span else None,
            "by_pool": {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])} if total else {},
            "idle_slots": idle / span if span else None, "idle_slots_stranded": idle_stranded / span if span else None}


def measure(config: str, overrides: list[str]) -> dict[str, Any]:
    """One simulated DORA run of ``config``: :func:`stranding` of its orchestrator and the run's rates."""
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.engine import Simulation

    cfg = load_sim_config(config, overrides, mode="dora")
    probes: list[_Probe] = []

    def factory(*a: Any, **k: Any) -> _Probe:
        probes.append(_Probe(*a, **k))
        return probes[-1]

    res = Simulation(cfg, orchestrator_factory=factory).run()
    s = res.summary
    return {"instances": cfg.cluster.rollout_instances("dora"), "max_staleness": cfg.orchestrator_config().max_staleness,
            **stranding(probes[0].trace),
            **{k: s.get(k) for k in ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction",
                                     "rollout_utilization", "migrations")}}


def trace_stranding(events: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    """:func:`stranding` of a real run from its Chrome-trace ``events`` (``trace.json``): engine
    tracks carry ``version`` spans (weights held), ``weight_sync`` spans (a load under way) and
    ``request`` spans; the trainer's ``train`` spans say which version each step ``produced``.
    ``cap``: request slots per engine. The pool state is the ages of the versions the engines hold."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [e for e in events if e.get("ph") == "X"]
    produced = sorted((e["ts"] + e["dur"], e["args"]["produced"]) for e in spans if e.get("cat") == "train")
    if len(produced) < 2:
        return {"stranded_fraction": None, "by_pool": {}, "idle_slots": None, "idle_slots_stranded": None}
    engines = sorted({e["tid"] for e in spans if e.get("cat") == "version" and names.get(e["tid"]) != "trainer"})
    held = {t: [(e["ts"], e["ts"] + e["dur"], e["args"]["version"]) for e in spans
                if e["tid"] == t and e.get("cat") in ("version", "weight_sync")] for t in engines}
    requests = {t: [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == t and e.get("cat") == "request"]
                for t in engines}
    start, end = produced[0][0], produced[-1][0]
    cuts = sorted({start, end, *(x for t in engines for a, b, _ in held[t] for x in (a, b)),
                   *(x for t in engines for a, b in requests[t] for x in (a, b)), *(p for p, _ in produced)})
    cuts = [c for c in cuts if start <= c <= end]
    trace: list[tuple[float, tuple[int, ...] | None, float]] = []
    for t0, t1 in zip(cuts, cuts[1:]):
        mid = (t0 + t1) / 2
        newest = max(v for p, v in produced if p <= mid)
        pool = {t: {v for a, b, v in held[t] if a <= mid < b} for t in engines}
        running = [sum(1 for a, b in requests[t] if a <= mid < b) for t in engines]
        idle = sum(max(0, cap - r) for r in running) / (cap * len(engines))
        stranded = not any(newest in vs for vs in pool.values())
        ages = tuple(sorted(newest - max(vs) for vs in pool.values() if vs)) if stranded else None
        trace.append((t0 / 1e6, ages, idle))
    trace.append((end / 1e6, None, 0.0))
    return stranding(trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="simulator config: run DORA on it")
    src.add_argument("--run-dir", help="a finished run's directory: read its trace.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    if args.config:
        out = measure(args.config, args.overrides)
    else:
        from pathlib import Path

        import yaml

        run = Path(args.run_dir)
        trace = json.loads((run / "trace.json").read_text())
        cap = yaml.safe_load((run / "config.yaml").read_text())["orchestrator"]["cap_before_rebalance"]
        out = trace_stranding(trace["traceEvents"] if isinstance(trace, dict) else trace, int(cap))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
