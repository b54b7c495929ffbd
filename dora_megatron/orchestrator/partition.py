"""Workload-proportional partition of the instance pool across live versions (DESIGN section 4.2),
and the hysteresis that decides whether a new partition is worth applying.

WHY pure: the paper leaves open how ``Round`` keeps the sum, what a version with work but a zero
share gets, and how to avoid thrashing; these functions pin those answers down and are tested
without any instance or request objects.
"""

from __future__ import annotations

from typing import Iterable, Mapping


def largest_remainder(total: int, weights: Mapping[int, float]) -> dict[int, int]:
    """Split ``total`` proportionally to ``weights`` so the parts sum to ``total`` exactly.

    Floors first, then one extra unit each to the largest fractional remainders (ties: larger
    weight, then newer version). All-zero weights give everything to the newest key.
    """
    if not weights:
        return {}
    wsum = float(sum(weights.values()))
    if wsum <= 0:
        out = {v: 0 for v in weights}
        out[max(weights)] = total
        return out
    quotas = {v: total * w / wsum for v, w in weights.items()}
    out = {v: int(q) for v, q in quotas.items()}
    left = total - sum(out.values())
    order = sorted(weights, key=lambda v: (quotas[v] - out[v], weights[v], v), reverse=True)
    for v in order[:left]:
        out[v] += 1
    return out


def partition(pool: int, demand: Mapping[int, float], required: Iterable[int],
              priority: Iterable[int] = (), floors: Mapping[int, int] | None = None) -> dict[int, int]:
    """Target instances per version: proportional to ``demand`` (largest remainder, sum = ``pool``)
    with at least one instance for each version in ``required``.

    When ``pool`` is smaller than the number of required versions, the minimums go first to the
    versions in ``priority`` (in that order), then to the oldest required versions; the others
    get 0 and wait (they are served when an instance frees up). Returns every version of
    ``demand`` and ``required`` (zeros included).

    ``floors[v]`` (e.g. ``ceil(requests_v / cap)``, so a version's requests fit under the
    per-instance cap) is a further minimum, applied only when every floor and every min-1 fit in
    ``pool`` together; the instances come from the versions furthest above their quota, never
    below their own floor/minimum. Otherwise floors are ignored (proportional split as above).
    """
    versions = set(demand) | set(required)
    if not versions:
        return {}
    req = set(required)
    ordered_req = [v for v in priority if v in req]
    ordered_req += sorted(req - set(ordered_req))
    mins = {v: 0 for v in versions}
    for v in ordered_req[:pool]:
        mins[v] = 1
    base = largest_remainder(pool, {v: max(0.0, float(demand.get(v, 0))) for v in versions})
    if sum(demand.get(v, 0) for v in versions) <= 0 and ordered_req:
        base = {v: 0 for v in versions}
        base[ordered_req[0]] = pool
    quotas_sum = float(sum(max(0.0, float(demand.get(v, 0))) for v in versions)) or 1.0
    quota = {v: pool * max(0.0, float(demand.get(v, 0))) / quotas_sum for v in versions}
    out = dict(base)
    for v in ordered_req[:pool]:
        if out[v] < 1:
            # take one from the version furthest above its quota that can spare one
            donors = [u for u in versions if out[u] > mins[u]]
            d = max(donors, key=lambda u: (out[u] - quota[u], out[u], -u))
            out[d] -= 1
            out[v] += 1
    if floors:
        lo = {v: max(mins[v], int(floors.get(v, 0))) for v in versions}
        if sum(lo.values()) <= pool:
            for v in sorted(versions):
                need = lo[v] - out[v]
                while need > 0:
                    # one exists: sum(lo) <= pool == sum(out) and out[v] < lo[v]
                    donors = [u for u in versions if out[u] > lo[u]]
                    d = max(donors, key=lambda u: (out[u] - quota[u], out[u], -u))
                    k = min(need, out[d] - lo[d])
                    out[d] -= k
                    out[v] += k
                    need -= k
    return out


def per_instance_load(cur: Mapping[int, int], demand: Mapping[int, float]) -> dict[int, float]:
    """Unfinished samples per instance for every version that holds instances."""
    return {v: demand.get(v, 0) / n for v, n in cur.items() if n > 0}


def should_apply(cur: Mapping[int, int], target: Mapping[int, int], demand: Mapping[int, float],
                 idle_versions: Iterable[int], imbalance_ratio: float) -> bool:
    """Hysteresis: apply ``target`` only if it differs from ``cur`` and it

    * gives an instance to a version that has none (stranded work or the new version), or
    * takes instances from a version that has idle instances (removes idle capacity), or
    * the per-instance load imbalance across versions exceeds ``imbalance_ratio``.
    """
    versions = set(cur) | set(target)
    if all(cur.get(v, 0) == target.get(v, 0) for v in versions):
        return False
    for v in versions:
        if cur.get(v, 0) == 0 and target.get(v, 0) > 0:
            return True
    idle = set(idle_versions)
    for v in versions:
        if target.get(v, 0) < cur.get(v, 0) and (v in idle or demand.get(v, 0) == 0):
            return True
    loads = per_instance_load(cur, demand)
    if len(loads) >= 2:
        hi, lo = max(loads.values()), min(loads.values())
        if lo <= 0:
            return hi > 0
        return hi / lo > imbalance_ratio
    return False
