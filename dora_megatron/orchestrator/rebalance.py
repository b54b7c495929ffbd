"""The dora rebalancer (DESIGN sections 4.2-4.3): partition the pool across live versions, move
instances and requests, level KV pressure, absorb overflow, serve the newest version beside a tail.

WHY a module of its own: it is the one rule set of the ``dora`` mode (``policy.rebalance``); the
other modes never reach it. It decides from the orchestrator's records and its
:class:`~.index.PoolIndex`, changes placements through the index only, and emits ``Migrate`` /
``SwitchVersion`` through the orchestrator (:meth:`~.core.Orchestrator._switch`), so the index stays
consistent with the records whichever rule moved a request.
"""

from __future__ import annotations

import itertools
import logging

from dora_megatron.orchestrator import partition as part
from dora_megatron.orchestrator import plan
from dora_megatron.orchestrator.actions import Migrate
from dora_megatron.orchestrator.host import RuleHost
from dora_megatron.orchestrator.index import BIG
from dora_megatron.orchestrator.rules import legacy_admits
from dora_megatron.types import Instance

log = logging.getLogger(__name__)


def rebalance(o: RuleHost, trigger: str) -> None:
    """Partition the pool across live versions and move instances/requests."""
    ix = o.index
    o._last_rebalance = o.now
    if trigger in ("timer", "kv", "idle"):
        # two-phase caps: the first load-balancing of a step ends the high-cap phase
        o._set_cap_phase(after=True)
    n_alive, running, idle_versions = o._pool_view()
    if not n_alive:
        return
    adm = o._admissible_new()
    unserved = ix.unserved()
    demand: dict[int, float] = {v: float(n) for v, n in unserved.items()}
    required = set(demand)
    if adm > 0:
        demand[o.newest] = demand.get(o.newest, 0.0) + adm * o.G
        required.add(o.newest)
    cur = ix.instances_by_version()
    # C-cap: a version keeps at least ceil(unfinished / cap) instances when the pool allows,
    # so a shrinking version's requests fit on its kept instances within the cap
    cap = ix.cap
    floors = ({v: -(-n // cap) for v, n in unserved.items()} if cap < BIG else None)
    target = part.partition(n_alive, demand, required, priority=running, floors=floors)
    for v in cur:
        target.setdefault(v, 0)
    if not part.should_apply(cur, target, demand, idle_versions, o.config.imbalance_ratio):
        return
    o.counters.rebalances += 1
    budget = o.config.max_migrations_per_rebalance or None
    # minimum gain (orchestrator.free_into_room); failure recovery (queued requests) is exempt
    into_room = o.config.free_into_room and cap < BIG and not any(ix.pending.values())
    insts = o.instances
    freed: list[str] = []
    for v in sorted(cur):
        n = cur.get(v, 0) - target.get(v, 0)
        if n <= 0:
            continue
        # (an instance holding a tail keeps its target: it cannot switch again until the tail drains)
        incoming = sorted(i for i in ix.incoming.get(v, ()) if insts[i].tail_version is None)
        take = incoming[:n]
        n -= len(take)
        active = ix.active.get(v, set())
        loads = {iid: len(insts[iid].samples) for iid in active}
        # an instance finishing a tail keeps its weights until the tail drains: not freed
        chosen = plan.choose_to_free({i: n_ for i, n_ in loads.items() if insts[i].tail_version is None}, n)
        if into_room:
            chosen = plan.free_into_room(chosen, loads, cap)
        if budget is not None:
            within = []
            for iid in chosen:  # least-loaded first
                if loads[iid] <= budget:
                    budget -= loads[iid]
                    within.append(iid)
            chosen = within
        chosen_set = set(chosen)
        kept = {iid: load for iid, load in loads.items() if iid not in chosen_set}
        if not kept and any(loads[i] for i in chosen):
            # never free the last active instance of a version that still runs requests
            chosen = [i for i in chosen if loads[i] == 0]
            chosen_set = set(chosen)
            kept = {iid: load for iid, load in loads.items() if iid not in chosen_set}
        _move_all_off(o, chosen, kept, v)
        freed.extend(take)
        freed.extend(chosen)
    deficits = {v: target[v] - cur.get(v, 0) for v in target if target[v] > cur.get(v, 0)}
    for iid, v in plan.assign_freed(freed, deficits).items():
        o._switch(insts[iid], v, rebalance=True)
    log.debug("rebalance(%s): %s -> %s", trigger, cur, target)


def _move_all_off(o: RuleHost, freed: list[str], kept: dict[str, int], version: int) -> None:
    """Every request of the ``freed`` instances goes to the ``kept`` ones (water-filling);
    costs O(kept log kept + moved) and one index update per touched instance.

    Cap policy (keeps C1 and C2, never drops KV): water-filling fills the least-loaded kept
    instances first, so no kept instance is pushed over the cap while the kept room
    suffices; the partition floors (``ceil(unfinished / cap)`` instances per version when the
    pool allows) make it suffice unless some of those instances are still switching in. When
    it does not (pool too small, or kept instances still switching
    in), the overflow is spread evenly *above* the cap rather than re-queued, because a
    re-queued running request loses its KV (re-prefill); the version's instances that finish
    switching take that excess at ``on_switch_done`` (:func:`absorb_overflow`), and the
    two-phase cap stops new work landing on them until they are back under it."""
    insts, out = o.instances, o._out
    sids: list[str] = []
    srcs: list[str] = []
    for iid in freed:
        own = sorted(insts[iid].samples)
        sids.extend(own)
        srcs.extend(itertools.repeat(iid, len(own)))
    if not sids:
        return
    k = 0
    for dst, q in plan.migration_quotas(len(sids), kept):
        o.index.move(sids[k:k + q], insts[dst])
        out.extend(map(Migrate, sids[k:k + q], srcs[k:k + q], itertools.repeat(dst, q), itertools.repeat(version, q)))
        k += q
    for iid in freed:
        o.index.vacate(insts[iid])
    o.counters.migrations += len(sids)


def _bulk_migrate(o: RuleHost, moves: list[tuple[str, str, str]], version: int) -> None:
    """Apply ``(sample, src, dst)`` moves with one index update per touched instance."""
    if not moves:
        return
    insts, out = o.instances, o._out
    for dst, chunk in plan.group_by_dst(moves).items():
        sids = [sid for sid, _ in chunk]
        o.index.move(sids, insts[dst])
        out.extend(map(Migrate, sids, [src for _, src in chunk], itertools.repeat(dst), itertools.repeat(version)))
    moved_from: dict[str, list[str]] = {}
    for sid, src, _ in moves:
        moved_from.setdefault(src, []).append(sid)
    for src, sids in moved_from.items():
        o.index.vacate(insts[src], sids)
    o.counters.migrations += len(moves)


def absorb_overflow(o: RuleHost, new: Instance) -> None:
    """A version grew: its newly active instance takes the requests its peers hold above the
    cap (most-loaded peer first, shortest requests first), up to the cap and the migration
    budget. Requests within the cap stay where their KV is (locality)."""
    v = new.version
    over = o.index.over.get(v) if v is not None else None
    if not over or v is None:
        return
    cap = o.index.cap
    room = cap - len(new.samples)
    budget = o.config.max_migrations_per_rebalance
    if budget:
        room = min(room, budget)
    insts, samples = o.instances, o.samples
    moves: list[tuple[str, str, str]] = []
    for iid in sorted(over, key=lambda i: (-len(insts[i].samples), i)):
        if room <= 0:
            break
        if iid == new.instance_id:
            continue
        src = insts[iid]
        k = min(len(src.samples) - cap, room)
        if k <= 0:
            continue
        victims = sorted((sid for sid in src.samples if samples[sid].version == v),
                         key=lambda sid: (samples[sid].tokens, sid))[:k]
        moves.extend((sid, iid, new.instance_id) for sid in victims)
        room -= k
    _bulk_migrate(o, moves, v)


def level(o: RuleHost, hot: Instance) -> None:
    """KV pressure: move the shortest requests of ``hot`` to the least-loaded peer of the same
    version until their loads are level (locality: only the pressured instance's requests)."""
    v = hot.version
    if v is None or not hot.alive or hot.switching:
        return
    peers = o.index.active.get(v, set())
    loads = {iid: o.instances[iid].load for iid in peers}
    res = plan.level_within_version(loads, hot.instance_id)
    if res is None:
        return
    dst, count = res
    samples = o.samples
    victims = sorted((sid for sid in hot.samples if samples[sid].version == v),
                     key=lambda sid: (samples[sid].tokens, sid))[:count]
    _bulk_migrate(o, [(sid, hot.instance_id, dst) for sid in victims], v)


def stranded(o: RuleHost) -> bool:
    """Work that no instance can serve: queued samples of a version without instances, or
    admissible new groups while no instance holds the newest version."""
    ix = o.index
    if any(q and not ix.served(v) for v, q in ix.pending.items()):
        return True
    return not ix.served(o.newest) and o._admissible_new() > 0


def serve_newest_beside_tail(o: RuleHost) -> None:
    """``orchestrator.dual_version``: the newest version still has admissible groups and no
    instance after the rebalance (every instance runs requests of an older version, and no
    C1-safe migration can free one: each holds a different version). Switch one to the newest
    now, keeping its requests as the tail of its old version (the engine keeps those weights
    beside the new ones until the tail drains).

    Which instance: one without a tail already (an engine holds at most two weight sets), not
    the last instance of a version with queued requests (they would have none), and of those
    the one with the fewest requests (the shortest tail: least time holding two sets)."""
    ix = o.index
    if ix.served(o.newest) or o._admissible_new() <= 0:
        return
    best: tuple[int, str] | None = None
    for v, ids in ix.active.items():
        if v >= o.newest or (ix.pending.get(v) and len(ids) == 1):
            continue
        for iid in ids:
            inst = o.instances[iid]
            if inst.tail_version is None and inst.samples and (best is None or (len(inst.samples), iid) < best):
                best = (len(inst.samples), iid)
    if best is not None:
        o._switch(o.instances[best[1]], o.newest, keep=True)


def legacy_fill(o: RuleHost) -> None:
    """Tier 2 (dora, optional): fill idle slots of legacy instances with groups of their own
    version when the (strict, legacy) admission rule allows."""
    ix = o.index
    for v in sorted(ix.active):
        if v >= o.newest or not ix.active[v] or ix.pending.get(v):
            continue
        while (ix.group_fits(v, o.G)
               and legacy_admits(v, o.newest, ix.dispatched, ix.consumed, o.outstanding, o.S, o.tbs, o.policy.rbs)):
            o._create_group(v)
            o._place_pending()
