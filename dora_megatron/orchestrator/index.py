"""The orchestrator's lookup tables, owned in one place and kept consistent with its records.

WHY a separate structure: the rules (:mod:`.core`, :mod:`.rebalance`, :mod:`.single_version`)
ask "which instances of version v have room", "how many requests of v still need an instance",
"which groups are finished" on every event; answering by a scan of every record would cost
O(instances + samples) per event. The tables answer in O(1) or O(versions), but each is a second
record of what the primary records (``Sample``, ``Group``, ``Instance``) already say, so every
change of a record that a table depends on goes through a method here, and :meth:`PoolIndex.rebuild`
derives every table from the records alone: the property test (tests/unit/orchestrator/
test_index.py) checks after each event of random runs that the kept tables equal the rebuilt ones,
and :meth:`~.core.Orchestrator.restore` builds its tables with the same function.

What is primary here and cannot be rebuilt from the records: the per-version dispatched/consumed
counts (consumed groups are forgotten) and the *order* of the two queues (pending samples per
version, finished groups per version): their membership is derived, their order is kept.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Mapping

from dora_megatron.types import FINISHED, PENDING, RUNNING, WAITING, Group, Instance, Sample

BIG = 1 << 40  # free slots of an uncapped instance


def inc(d: dict[int, int], k: int, n: int = 1) -> None:
    d[k] = d.get(k, 0) + n


def dec(d: dict[int, int], k: int, n: int = 1) -> None:
    left = d[k] - n
    if left:
        d[k] = left
    else:
        del d[k]


class PoolIndex:
    """Per-version tables over the orchestrator's records (``instances``, ``samples``: the same
    dicts the orchestrator holds; the index reads them and updates the fields that place a sample
    or an instance, so that a record and its tables change together)."""

    def __init__(self, instances: dict[str, Instance], samples: dict[str, Sample], cap: int) -> None:
        self.instances = instances
        self.samples = samples
        self.cap = cap  # per-instance cap in force (BIG: uncapped)
        # groups: running counts (primary: consumed groups are forgotten) and per-version tables
        self.total_dispatched = 0
        self.total_consumed = 0
        self.dispatched: dict[int, int] = {}
        self.consumed: dict[int, int] = {}
        self.unconsumed: dict[int, int] = {}
        self.finished_groups: dict[int, dict[str, None]] = {}  # complete, unconsumed; completion order
        # samples
        self.unfinished: dict[int, int] = {}
        self.pending: dict[int, dict[str, None]] = {}  # queued per version; queue order
        # instances: serving per version, switching in per version
        self.active: dict[int, set[str]] = {}
        self.incoming: dict[int, set[str]] = {}
        # serving instances under the cap, free slots per version, and each instance's share of them
        self.room: dict[int, set[str]] = {}
        self.free: dict[int, int] = {}
        self.contrib: dict[str, tuple[int, int]] = {}
        # serving instances holding more requests than the cap, per version (leveled onto new ones)
        self.over: dict[int, set[str]] = {}
        self.over_v: dict[str, int] = {}
        # per version, serving instances that hold at least one request (and the version each
        # instance is counted under), and the number of alive instances: what a rebalance asks of
        # the whole pool, kept exact so that a rebalance costs O(versions), not O(instances)
        self.busy: dict[int, int] = {}
        self.busy_v: dict[str, int] = {}
        self.n_alive = 0
        # per version, requests held as the tail of instances that serve a newer version
        # (orchestrator.dual_version): served, so not demand for an instance of their version
        self.tail_held: dict[int, int] = {}

    # ------------------------------------------------------------------ groups and samples

    def add_group(self, g: Group, samples: Iterable[Sample]) -> None:
        """A dispatched group: its samples queue on its version."""
        pend = self.pending.setdefault(g.version, {})
        for s in samples:
            self.samples[s.sample_id] = s
            pend[s.sample_id] = None
        self.total_dispatched += 1
        inc(self.dispatched, g.version)
        inc(self.unconsumed, g.version)
        inc(self.unfinished, g.version, len(g.sample_ids))

    def consume(self, g: Group) -> None:
        """``g`` was released to training (its records are forgotten by the caller)."""
        fin = self.finished_groups[g.version]
        del fin[g.group_id]
        if not fin:
            del self.finished_groups[g.version]
        dec(self.unconsumed, g.version)
        inc(self.consumed, g.version)
        self.total_consumed += 1

    def finish(self, s: Sample, g: Group) -> bool:
        """``s`` finished (off its queue or its instance); True when that completed ``g``."""
        if s.state == PENDING:
            self.pending[s.version].pop(s.sample_id, None)
        elif s.state == RUNNING:
            self.unassign(s)
        s.state, s.turn_from = FINISHED, None
        dec(self.unfinished, s.version)
        g.n_finished += 1
        if g.complete:
            self.finished_groups.setdefault(g.version, {})[g.group_id] = None
        return g.complete

    def retag(self, s: Sample, version: int) -> None:
        """``s`` continues on ``version`` (partial mode)."""
        dec(self.unfinished, s.version)
        inc(self.unfinished, version)
        s.version = version

    def queue(self, s: Sample) -> None:
        s.state = PENDING
        self.pending.setdefault(s.version, {})[s.sample_id] = None

    def assign(self, s: Sample, inst: Instance) -> None:
        s.instance = inst.instance_id
        s.state = RUNNING
        inst.samples.add(s.sample_id)
        self.refresh(inst)

    def unassign(self, s: Sample) -> None:
        inst = self.instances[s.instance]  # type: ignore[index]
        inst.samples.discard(s.sample_id)
        s.instance = None
        if inst.tail_version is not None and s.version == inst.tail_version:
            dec(self.tail_held, s.version)
            inst.tail_left -= 1
            if inst.tail_left == 0:  # the tail drained: the engine drops its weights
                inst.tail_version = None
        self.refresh(inst)

    def move(self, sids: list[str], dst: Instance) -> None:
        """``sids`` now run on ``dst`` (a migration; their sources are updated by :meth:`vacate`)."""
        dst.samples.update(sids)
        samples = self.samples
        for sid in sids:
            samples[sid].instance = dst.instance_id
        self.refresh(dst)

    def vacate(self, src: Instance, sids: list[str] | None = None) -> None:
        """``sids`` (None: every request) left ``src`` by migration."""
        ss = src.samples
        if sids is None or len(sids) == len(ss):
            ss.clear()
        else:
            ss.difference_update(sids)
        self.refresh(src)

    # ------------------------------------------------------------------ instances

    def add_instance(self, inst: Instance, version: int | None) -> None:
        """A new alive instance: serving ``version`` (None: it is switched in by the caller)."""
        self.instances[inst.instance_id] = inst
        self.n_alive += 1
        if version is not None:
            self.activate(inst, version)

    def fail(self, inst: Instance) -> None:
        self.deactivate(inst)
        inst.alive = False
        self.n_alive -= 1

    def activate(self, inst: Instance, version: int) -> None:
        inst.version = version
        inst.target = None
        self.active.setdefault(version, set()).add(inst.instance_id)
        self.refresh(inst)

    def switched(self, inst: Instance, version: int) -> None:
        """``inst`` finished switching to ``version``: it serves it now."""
        self.incoming[version].discard(inst.instance_id)
        self.activate(inst, version)

    def begin_switch(self, inst: Instance, version: int, keep: bool) -> int | None:
        """``inst`` starts loading ``version``; with ``keep`` its requests become the tail of its
        old version (returned). It serves nothing until :meth:`switched`."""
        kept = None
        if keep:
            assert inst.tail_version is None and inst.version is not None and inst.samples
            kept = inst.tail_version = inst.version
            inst.tail_left = len(inst.samples)
            inc(self.tail_held, kept, inst.tail_left)
        else:
            assert not inst.samples, "switching an instance that still holds requests"
        self.deactivate(inst)
        inst.target = version
        self.incoming.setdefault(version, set()).add(inst.instance_id)
        return kept

    def deactivate(self, inst: Instance) -> None:
        if inst.target is not None:
            self.incoming.get(inst.target, set()).discard(inst.instance_id)
        if inst.version is not None:
            self.active.get(inst.version, set()).discard(inst.instance_id)
        ov = self.over_v.pop(inst.instance_id, None)
        if ov is not None:
            self.over[ov].discard(inst.instance_id)
        self._track_busy(inst.instance_id, None)
        old_v, old_c = self.contrib.pop(inst.instance_id, (None, 0))
        if old_v is not None:
            self.free[old_v] -= old_c
            self.room.get(old_v, set()).discard(inst.instance_id)

    def set_cap(self, cap: int) -> None:
        self.cap = cap
        for ids in self.active.values():
            for iid in ids:
                self.refresh(self.instances[iid])

    def refresh(self, inst: Instance) -> None:
        """Keep ``room`` (instances under the cap), ``free`` (free slots per version), ``over`` and
        ``busy`` exact for ``inst`` after its load, version or state changed."""
        iid = inst.instance_id
        v = inst.version
        serving = v is not None and inst.alive and inst.target is None
        n = len(inst.samples)
        self._track_busy(iid, v if serving and n else None)
        c = self.cap - n if serving else 0
        if c < 0:
            c = 0
        is_over = serving and n > self.cap
        ov = self.over_v.get(iid)
        if ov is not None and (not is_over or ov != v):
            self.over[ov].discard(iid)
            del self.over_v[iid]
            ov = None
        if is_over and ov is None and v is not None:  # (is_over implies a serving version)
            self.over.setdefault(v, set()).add(iid)
            self.over_v[iid] = v
        old = self.contrib.get(iid)
        if old is not None:
            ov, oc = old
            if serving and ov == v:
                if oc != c:
                    self.free[v] += c - oc
                    self.contrib[iid] = (v, c)
                    if c > 0 and oc == 0:
                        self.room.setdefault(v, set()).add(iid)
                    elif c == 0:
                        self.room[v].discard(iid)
                return
            self.free[ov] -= oc
            self.room.get(ov, set()).discard(iid)
            del self.contrib[iid]
        if not serving or v is None:  # (serving implies a version)
            return
        if c > 0:
            self.room.setdefault(v, set()).add(iid)
        self.free[v] = self.free.get(v, 0) + c
        self.contrib[iid] = (v, c)

    def _track_busy(self, iid: str, version: int | None) -> None:
        """Count ``iid`` as a busy serving instance of ``version`` (None: not counted)."""
        old = self.busy_v.get(iid)
        if old == version:
            return
        if old is not None:
            dec(self.busy, old)
            del self.busy_v[iid]
        if version is not None:
            inc(self.busy, version)
            self.busy_v[iid] = version

    # ------------------------------------------------------------------ queries

    def served(self, v: int) -> bool:
        """Some instance serves ``v`` or is switching to it."""
        return bool(self.active.get(v) or self.incoming.get(v))

    def pool_view(self) -> tuple[int, list[int], set[int]]:
        """What a rebalance needs of the whole pool: the number of alive instances, the versions
        whose serving instances run requests (oldest first) and the versions with an idle serving
        instance. O(versions)."""
        running = sorted(v for v, n in self.busy.items() if n > 0)
        idle = {v for v, ids in self.active.items() if len(ids) > self.busy.get(v, 0)}
        return self.n_alive, running, idle

    def unserved(self) -> dict[int, int]:
        """Unfinished requests per version that need an instance of their version: all but those
        finishing as the tail of an instance that serves a newer version."""
        held = self.tail_held
        out = {}
        for v, n in self.unfinished.items():
            n -= held.get(v, 0)
            if n > 0:
                out[v] = n
        return out

    def instances_by_version(self) -> dict[int, int]:
        """Active plus incoming (switching) instances per version."""
        out: dict[int, int] = {}
        for d in (self.active, self.incoming):
            for v, ids in d.items():
                if ids:
                    out[v] = out.get(v, 0) + len(ids)
        return out

    def live_versions(self, newest: int) -> list[int]:
        """Versions with unconsumed groups, plus ``newest``."""
        return sorted({v for v, n in self.unconsumed.items() if n > 0} | {newest})

    def pick(self, version: int, k: int) -> list[str]:
        """Instances for ``k`` new placements on ``version``: least-loaded first, within the cap
        (uncapped: any serving instance). May return fewer than ``k``."""
        cap = self.cap
        cands = self.room.get(version, set()) if cap != BIG else self.active.get(version, set())
        if not cands or k <= 0:
            return []
        insts = self.instances
        if len(cands) > 4 * k:
            heap = heapq.nsmallest(k, ((insts[i].load, i) for i in cands))
        else:
            heap = [(insts[i].load, i) for i in cands]
        heapq.heapify(heap)
        out: list[str] = []
        while heap and len(out) < k:
            load, iid = heapq.heappop(heap)
            out.append(iid)
            if load + 1 < cap:
                heapq.heappush(heap, (load + 1, iid))
        return out

    def group_fits(self, version: int, group_size: int) -> bool:
        """A new group fits when ``group_size`` slots are free on the version's serving instances,
        or, when the whole version has fewer, when all of them are free (never stuck on G > cap)."""
        n_active = len(self.active.get(version, ()))
        if not n_active:
            return False
        need = group_size if self.cap == BIG else min(group_size, self.cap * n_active)
        return self.free.get(version, 0) >= need

    def fold_counts(self, newest: int) -> None:
        """Merge the per-version dispatched/consumed counts of versions below every version a
        rule can still ask about into one bucket (keyed by the newest folded version).

        Exact: :func:`~.rules.legacy_admits` sums ``dispatched`` over versions ``<= v`` and
        ``consumed`` over versions ``> v`` for a queried ``v`` that is held by an instance (or is
        the newest), and every folded version is below each such ``v``, so both sums are
        unchanged; no instance can later be switched below the floor (switches go to the newest
        version or to one with unconsumed groups, and the oldest unconsumed version only rises).
        Keeps these dicts O(live versions) instead of O(steps)."""
        floor = min((v for d in (self.active, self.incoming) for v, ids in d.items() if ids), default=newest)
        floor = min(floor, newest, min(self.unconsumed, default=newest), min(self.pending, default=newest))
        for d in (self.dispatched, self.consumed):
            old = [v for v in d if v < floor]
            if len(old) > 1:
                key = max(old)
                d[key] = sum(d.pop(v) for v in old)

    def lost_groups(self) -> int:
        """The number of unconsumed groups with a sample that is neither running on an alive
        instance, queued, between turns nor finished (0 unless a rule lost one). O(samples)."""
        lost = set()
        for s in self.samples.values():
            if s.state == RUNNING:
                inst = self.instances.get(s.instance or "")
                ok = inst is not None and inst.alive and s.sample_id in inst.samples
            elif s.state == PENDING:
                ok = s.sample_id in self.pending.get(s.version, {})
            else:
                ok = s.state in (FINISHED, WAITING)
            if not ok:
                lost.add(s.group_id)
        return len(lost)

    # ------------------------------------------------------------------ from the records alone

    @classmethod
    def rebuild(cls, instances: dict[str, Instance], samples: dict[str, Sample], groups: dict[str, Group],
                cap: int, dispatched: dict[int, int], consumed: dict[int, int],
                finished_order: Mapping[int, Iterable[str]], pending_order: Mapping[int, Iterable[str]]) -> "PoolIndex":
        """Every table derived from the records, given what is primary in the index: the
        dispatched/consumed counts and the order of the two queues (their members are what the
        records say; the order lists only order them). Used by restore and by the consistency test."""
        ix = cls(instances, samples, cap)
        ix.dispatched, ix.consumed = dict(dispatched), dict(consumed)
        ix.total_dispatched = sum(dispatched.values())
        ix.total_consumed = sum(consumed.values())
        for g in groups.values():
            inc(ix.unconsumed, g.version)
        for s in samples.values():
            if s.state != FINISHED:
                inc(ix.unfinished, s.version)
        # the queues: members from the records, in the kept order (members it lacks come last)
        for v, ids in finished_order.items():
            ix.finished_groups[v] = dict.fromkeys(i for i in ids if i in groups and groups[i].complete)
        for g in groups.values():
            if g.complete:
                ix.finished_groups.setdefault(g.version, {})[g.group_id] = None
        for v, ids in pending_order.items():
            ix.pending[v] = dict.fromkeys(i for i in ids if i in samples and samples[i].state == PENDING
                                          and samples[i].version == v)
        for s in samples.values():
            if s.state == PENDING:
                ix.pending.setdefault(s.version, {})[s.sample_id] = None
        for inst in instances.values():
            if not inst.alive:
                continue
            ix.n_alive += 1
            if inst.tail_version is not None:
                inc(ix.tail_held, inst.tail_version, inst.tail_left)
            if inst.target is not None:
                ix.incoming.setdefault(inst.target, set()).add(inst.instance_id)
            elif inst.version is not None:
                ix.active.setdefault(inst.version, set()).add(inst.instance_id)
                ix.refresh(inst)
        return ix

    def tables(self) -> dict[str, object]:
        """Every table with empty entries dropped (the kept tables may hold an emptied set or a
        zero count that a rebuild never creates): what :meth:`rebuild` must reproduce."""
        def sets(d: dict[int, set[str]]) -> dict[int, set[str]]:
            return {k: set(v) for k, v in d.items() if v}

        def counts(d: dict[int, int]) -> dict[int, int]:
            return {k: n for k, n in d.items() if n}

        def queues(d: dict[int, dict[str, None]]) -> dict[int, list[str]]:
            return {k: list(q) for k, q in d.items() if q}

        return {
            "total_dispatched": self.total_dispatched, "total_consumed": self.total_consumed,
            "dispatched": counts(self.dispatched), "consumed": counts(self.consumed),
            "unconsumed": counts(self.unconsumed), "unfinished": counts(self.unfinished),
            "finished_groups": queues(self.finished_groups), "pending": queues(self.pending),
            "active": sets(self.active), "incoming": sets(self.incoming), "room": sets(self.room),
            "free": counts(self.free), "contrib": {k: c for k, c in self.contrib.items()},
            "over": sets(self.over), "over_v": dict(self.over_v), "busy": counts(self.busy),
            "busy_v": dict(self.busy_v), "n_alive": self.n_alive, "tail_held": counts(self.tail_held),
        }
