"""Move plans for a re-partition (DESIGN section 4.3): which instances a shrinking version frees,
where their requests go, and which growing version each freed instance joins.

WHY: locality first. A request moves only if its instance changes version, and then to the
least-loaded instance that keeps its version, so transfers (KV bytes, or re-prefill on SGLang) are
the minimum the new partition needs. Pure functions over ids and counts.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence


def choose_to_free(loads: Mapping[str, int], n: int) -> list[str]:
    """The ``n`` instances with the least in-flight work (ties: instance id)."""
    if n <= 0:
        return []
    return [iid for _, iid in heapq.nsmallest(n, ((load, iid) for iid, load in loads.items()))]


def free_into_room(chosen: Sequence[str], loads: Mapping[str, int], cap: int) -> list[str]:
    """The instances of ``chosen`` (to be freed, least-loaded first) whose requests fit under ``cap``
    on the instances of ``loads`` that stay, so that no moved request waits at its destination for a
    running slot it had at its source (a minimum gain: such a move frees its source's slot only by
    taking one it cannot have yet). An instance that does not fit stays, and its own room counts
    for the ones after it."""
    out: set[str] = set(chosen)
    room = sum(max(0, cap - load) for iid, load in loads.items() if iid not in out)
    for iid in sorted(chosen, key=lambda i: (loads[i], i)):
        if loads[iid] <= room:
            room -= loads[iid]
        else:
            out.discard(iid)
            room += max(0, cap - loads[iid])
    return [iid for iid in chosen if iid in out]


def migration_quotas(n_moving: int, kept_loads: Mapping[str, int]) -> list[tuple[str, int]]:
    """How many of ``n_moving`` requests each kept instance receives, by water-filling: the
    least-loaded instances are raised to a common level first (the same counts as sending each
    request to the currently least-loaded instance, ties by id), in O(K log K).

    Returns ``(instance, count)`` with count > 0, least-loaded first; empty ``kept_loads`` returns
    nothing (the caller must not free the last instance of a version that still has requests).
    """
    if not kept_loads or n_moving <= 0:
        return []
    items = sorted((load, iid) for iid, load in kept_loads.items())
    n = len(items)
    remaining = n_moving
    level = items[0][0]
    i = 0
    extra = 0
    while True:
        while i < n and items[i][0] <= level:
            i += 1
        nxt = items[i][0] if i < n else None
        if nxt is None or remaining <= (nxt - level) * i:
            full, extra = divmod(remaining, i)
            level += full
            break
        remaining -= (nxt - level) * i
        level = nxt
    # the first i instances reach ``level``; ties at the level go to the smallest ids
    extra_ids = set(sorted(iid for _, iid in items[:i])[:extra])
    out = []
    for load, iid in items[:i]:
        q = level - load + (1 if iid in extra_ids else 0)
        if q > 0:
            out.append((iid, q))
    return out


def assign_migrations(moving: Sequence[tuple[str, str]], kept_loads: Mapping[str, int]
                      ) -> list[tuple[str, str, str]]:
    """``(sample_id, src)`` -> ``(sample_id, src, dst)`` following :func:`migration_quotas`."""
    out: list[tuple[str, str, str]] = []
    k = 0
    for iid, q in migration_quotas(len(moving), kept_loads):
        out.extend((sid, src, iid) for sid, src in moving[k:k + q])
        k += q
    return out


def group_by_dst(moves: Sequence[tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    """``(sample, src, dst)`` triples as ``dst -> [(sample, src), ...]`` (order kept)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for sid, src, dst in moves:
        lst = out.get(dst)
        if lst is None:
            lst = out[dst] = []
        lst.append((sid, src))
    return out


def assign_freed(freed: Sequence[str], deficits: Mapping[int, int]) -> dict[str, int]:
    """Give freed instances to growing versions: newest version first, ``deficits[v]`` each."""
    out: dict[str, int] = {}
    it = iter(freed)
    for v in sorted(deficits, reverse=True):
        for _ in range(deficits[v]):
            iid = next(it, None)
            if iid is None:
                return out
            out[iid] = v
    return out


def level_within_version(loads: Mapping[str, int], hot: str) -> tuple[str, int] | None:
    """Intra-version leveling for a KV-pressured instance: move half the load difference from
    ``hot`` to the least-loaded peer. Returns ``(dst, count)`` or None when already level."""
    peers = [(load, iid) for iid, load in loads.items() if iid != hot]
    if not peers:
        return None
    load, dst = min(peers)
    count = (loads[hot] - load) // 2
    return (dst, count) if count > 0 else None
