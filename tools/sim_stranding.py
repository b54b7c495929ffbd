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
  versions back (no migration can free either), ``[1, 1]`` one version on both (consolidation can).

    python tools/sim_stranding.py --config configs/sim/tiny.yaml --set cluster.total_gpus=12 \
        --set orchestrator.max_staleness=3 --set sim.steps=40 --set cost.train_fixed_s=20
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
        self.trace: list[tuple[float, tuple[int, ...] | None]] = []

    def _fill(self):  # noqa: ANN202 - same contract as the parent
        out = super()._fill()
        served = bool(self._active.get(self.newest) or self._incoming.get(self.newest))
        pool = None
        if not served and self._admissible_new() > 0:
            pool = tuple(sorted(self.newest - (i.version if i.version is not None else i.target)
                                for i in self.instances.values() if i.alive))
        self.trace.append((self.now, pool))
        return out


def stranding(trace: list[tuple[float, tuple[int, ...] | None]]) -> dict[str, Any]:
    """Stranded share of the traced span and its split by pool state (from the probe's trace)."""
    trace = sorted(trace, key=lambda r: r[0])
    span = trace[-1][0] - trace[0][0] if len(trace) > 1 else 0.0
    by: dict[str, float] = {}
    for (t0, pool), (t1, _) in zip(trace, trace[1:]):
        if pool is not None:
            by[str(list(pool))] = by.get(str(list(pool)), 0.0) + t1 - t0
    total = sum(by.values())
    return {"stranded_fraction": total / span if span else None,
            "by_pool": {k: v / total for k, v in sorted(by.items(), key=lambda kv: -kv[1])} if total else {}}


def main() -> None:
    from dora_megatron.config.sim import load_sim_config
    from dora_megatron.sim.engine import Simulation

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = load_sim_config(args.config, args.overrides, mode="dora")
    probes: list[_Probe] = []

    def factory(*a: Any, **k: Any) -> _Probe:
        probes.append(_Probe(*a, **k))
        return probes[-1]

    res = Simulation(cfg, orchestrator_factory=factory).run()
    s = res.summary
    out = {"instances": cfg.cluster.rollout_instances("dora"), "max_staleness": cfg.orchestrator_config().max_staleness,
           **stranding(probes[0].trace),
           **{k: s.get(k) for k in ("throughput_tokens_per_s", "mean_step_time_s", "rollout_only_fraction",
                                    "rollout_utilization", "migrations")}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
