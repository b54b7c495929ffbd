"""The orchestrator state machine: events in, actions out, no I/O (DESIGN sections 2-4).

WHY one object for every mode and driver: the runtime (asyncio + HTTP) and the simulator (virtual
clock) must make identical decisions, and the baselines must differ from DORA only by policy, so
every decision lives here and every input arrives as an explicit event. The object never reads a
clock, sleeps, spawns or sends; it only returns actions for the driver to execute in order.

Internals are dicts/sets keyed by id plus per-version counters, so events cost O(touched samples)
and a rebalance costs O(instances + moved requests), never O(all requests).

WHY it forgets: a consumed group (and its samples) is dropped at release: its record is the
``ReleaseBatch`` the driver logs (``consumed.jsonl``), and keeping it would make memory, ``audit``
and every checkpoint grow with the run's history. What the rules still need of the past are
counts (groups dispatched / consumed per version, the C1/C2/C3 counters), kept as running
counters; per-version counts of versions no rule can ask about any more are folded into one
bucket. State and snapshot are therefore O(outstanding work + live versions).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import operator
from typing import Any, Iterable

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import partition as part
from dora_megatron.orchestrator import plan
from dora_megatron.orchestrator.actions import (Action, Dispatch, Interrupt, Migrate, ReleaseBatch, Submit,
                                                SwitchVersion)
from dora_megatron.orchestrator.policy import ModePolicy
from dora_megatron.orchestrator.rules import admits, legacy_admits, select_batch
from dora_megatron.types import FINISHED, PENDING, RUNNING, WAITING, Group, Instance, Sample

log = logging.getLogger(__name__)

_INF = float("inf")
_BIG = 1 << 40  # free slots of an uncapped instance
# 2: consumed groups are not in the snapshot; per-version counts are (1: every group ever made)
_SNAPSHOT_FORMAT = 2
# The snapshot reads the records' fields directly (what ``dataclasses.asdict`` gives, at a fraction
# of its cost: asdict deep-copies field by field, ~0.5 s for the 4,096 instances and 16k samples of
# a large pool, all in the one loop turn of a checkpoint). Every field is an immutable value except
# the two containers, which the snapshot copies (``Group.sample_ids``, ``Instance.samples``).
_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(Group))
_INSTANCE_FIELDS = tuple(f.name for f in dataclasses.fields(Instance))
_sample_values = operator.attrgetter(*_SAMPLE_FIELDS)
_group_values = operator.attrgetter(*_GROUP_FIELDS)
_instance_values = operator.attrgetter(*_INSTANCE_FIELDS)


@dataclasses.dataclass
class Counters:
    """Run counters; names match the summary.json fields (DESIGN section 11)."""

    dispatched_groups: int = 0
    consumed_groups: int = 0
    duplicated_groups: int = 0
    c1_violations: int = 0
    c3_violations: int = 0
    max_consumed_staleness: int = 0
    staleness_histogram: dict[int, int] = dataclasses.field(default_factory=dict)
    migrations: int = 0
    reprefill_tokens: int = 0
    interrupts: int = 0
    switches: int = 0
    rebalances: int = 0
    max_live_versions: int = 0
    ignored_events: int = 0
    workflow_turn_moves: int = 0
    dual_switches: int = 0


class Orchestrator:
    """Sans-IO orchestrator. See the package docstring for the event/action contract."""

    def __init__(self, config: OrchestratorConfig, instances: Iterable[str]) -> None:
        config.check("orchestrator")
        self.config = config
        self.policy = ModePolicy.from_config(config)
        self.S = self.policy.max_staleness
        self.tbs = config.tbs
        self.G = config.group_size
        self.newest = 0
        self.next_step = 0
        self.trainer_busy = False
        self.now = 0.0
        self.counters = Counters()
        self.groups: dict[str, Group] = {}
        self.samples: dict[str, Sample] = {}
        self.instances: dict[str, Instance] = {}
        self._group_seq = 0
        self._total_dispatched = 0
        self._total_consumed = 0
        self._dispatched: dict[int, int] = {}
        self._consumed: dict[int, int] = {}
        self._unconsumed: dict[int, int] = {}
        self._finished_groups: dict[int, dict[str, None]] = {}
        self._unfinished: dict[int, int] = {}
        self._pending: dict[int, dict[str, None]] = {}
        self._active: dict[int, set[str]] = {}
        self._incoming: dict[int, set[str]] = {}
        self._room: dict[int, set[str]] = {}
        self._free: dict[int, int] = {}
        self._contrib: dict[str, tuple[int, int]] = {}
        self._cap_after = False
        self._cap_value = self._compute_cap()
        self._cap_int = _BIG if self._cap_value == _INF else int(self._cap_value)
        self._last_rebalance: float | None = None
        self._last_kv_rebalance: float | None = None
        # batch release is re-evaluated only when it can have become possible: a group completed,
        # a step ended (new step index, trainer idle) or the state was restored
        self._release_dirty = True
        # serving instances holding more requests than the cap, per version (leveled onto new ones)
        self._over: dict[int, set[str]] = {}
        self._over_v: dict[str, int] = {}
        # per version, serving instances that hold at least one request (and the version each
        # instance is counted under), and the number of alive instances: what a rebalance asks
        # of the whole pool, kept exact on every change so that the rebalance triggered by each
        # finished sample costs O(versions), not O(instances)
        self._busy: dict[int, int] = {}
        self._busy_v: dict[str, int] = {}
        self._n_alive = 0
        # per version, requests held as the tail of instances that serve a newer version
        # (orchestrator.dual_version): served, so not demand for an instance of their version
        self._tail_held: dict[int, int] = {}
        self._out: list[Action] = []
        for iid in instances:
            if iid in self.instances:
                raise ValueError(f"duplicate instance id {iid!r}")
            inst = Instance(iid, version=0)
            self.instances[iid] = inst
            self._n_alive += 1
            self._activate(inst, 0)

    # ------------------------------------------------------------------ events

    def start(self) -> list[Action]:
        """First actions (initial dispatch). Call once after construction."""
        if self.policy.rebalance:
            self._rebalance("start")
        return self._fill()

    def on_tick(self, now: float) -> list[Action]:
        """Time passes (the driver's clock). Runs the timer-triggered rebalance (dora)."""
        self.now = now
        interval = self.config.rebalance_interval_s
        if (self.policy.rebalance and interval > 0
                and (self._last_rebalance is None or now - self._last_rebalance >= interval)):
            self._rebalance("timer")
        return self._fill()

    def on_sample_progress(self, sample_id: str, tokens: int) -> list[Action]:
        """``sample_id`` has generated ``tokens`` so far (optional; used for re-prefill counts and
        for choosing cheap requests to move)."""
        s = self.samples.get(sample_id)
        if s is not None and s.state != FINISHED:
            s.tokens = tokens
        return []

    def on_sample_versions(self, sample_id: str, versions: Iterable[int]) -> list[Action]:
        """The engine says which weight versions produced tokens of ``sample_id`` (an answer that
        crossed a weight update, or an engine holding other weights than it was routed for).

        WHY here: C1 is counted in one place, at release, from each sample's version span; the
        driver reports what the engine saw, the orchestrator widens the span. Unknown (consumed,
        forgotten) samples are ignored."""
        s = self.samples.get(sample_id)
        if s is None:
            self.counters.ignored_events += 1
            return []
        for v in versions:
            if v < s.min_version:
                s.min_version = v
            if v > s.max_version:
                s.max_version = v
        return []

    def on_sample_finished(self, sample_id: str, tokens: int | None = None,
                           now: float | None = None) -> list[Action]:
        """``sample_id`` finished generating (``tokens``: its response length). Unknown or already
        finished samples are ignored (counted in ``ignored_events``), so duplicates are harmless."""
        if now is not None:
            self.now = now
        s = self.samples.get(sample_id)
        if s is None or s.state == FINISHED:
            self.counters.ignored_events += 1
            return []
        if tokens is not None:
            s.tokens = tokens
        inst = self.instances.get(s.instance) if s.instance is not None else None
        if s.state == PENDING:
            self._pending[s.version].pop(sample_id, None)
        elif s.state == RUNNING:
            self._unassign(s)
        s.state, s.turn_from = FINISHED, None
        self._dec(self._unfinished, s.version)
        g = self.groups[s.group_id]
        g.n_finished += 1
        if g.complete:
            self._finished_groups.setdefault(g.version, {})[g.group_id] = None
            self._release_dirty = True
        if self.policy.rebalance and inst is not None and inst.load == 0 and inst.alive:
            self._rebalance("idle")
        return self._fill()

    def on_turn_ended(self, sample_id: str) -> list[Action]:
        """A turn of a workflow's trajectory returned: the trajectory is off its instance while its
        tool (or environment) runs, so its slot is free for other work until :meth:`on_turn_ready`.

        WHY: a tool call can last longer than a turn; holding the slot through it leaves the
        instance idle with work queued. The sample keeps its version (C1 is per trajectory) and
        still counts as unfinished work of that version (demand for the rebalance)."""
        s = self.samples.get(sample_id)
        if s is None or s.state != RUNNING:
            self.counters.ignored_events += 1  # moved, interrupted or failed over meanwhile
            return []
        s.turn_from = s.instance
        self._unassign(s)
        s.state = WAITING
        return self._fill()

    def on_turn_ready(self, sample_id: str) -> list[Action]:
        """The trajectory of ``sample_id`` wants its next turn: it is placed like a queued sample of
        its version (the instance of its last turn first when it has room and no sample of the
        version waits, for its prefix cache); another instance of the version is a move between
        turns (``workflow_turn_moves``), its prefix is computed again there."""
        s = self.samples.get(sample_id)
        if s is None or s.state != WAITING:
            self.counters.ignored_events += 1
            return []
        last = self.instances.get(s.turn_from or "")
        if (last is not None and not self.policy.interrupt and not self._pending.get(s.version)
                and last.instance_id in self._room.get(s.version, ())):
            self._submit(s, last, s.version)
        else:
            self._make_pending(s)
        return self._fill()

    def on_instance_stats(self, instance: str, running: int, kv_usage: float,
                          now: float | None = None) -> list[Action]:
        """Engine-reported load of ``instance``; KV usage over the watermark levels it with its
        least-loaded peer and triggers a full rebalance at most once per
        ``kv_rebalance_min_interval_s`` (driver time: ``now``, else the last time seen)."""
        if now is not None:
            self.now = now
        inst = self.instances.get(instance)
        if inst is None or not inst.alive:
            self.counters.ignored_events += 1
            return []
        inst.reported_running = running
        inst.kv_usage = kv_usage
        if self.policy.rebalance and kv_usage >= self.config.kv_high_watermark and not inst.switching:
            gap = self.config.kv_rebalance_min_interval_s
            last = self._last_kv_rebalance
            if gap <= 0 or last is None or self.now - last >= gap or self.now < last:
                self._last_kv_rebalance = self.now
                self._rebalance("kv")
            self._level(inst)
        return self._fill()

    def on_step_finished(self, version: int) -> list[Action]:
        """The trainer finished step ``version - 1`` and produced weights ``version``."""
        if version != self.next_step or not self.trainer_busy:
            raise ValueError(f"step_finished({version}) but the trainer runs step {self.next_step - 1} "
                             f"(busy={self.trainer_busy})")
        self.trainer_busy = False
        self._release_dirty = True
        self.newest = version
        if self.policy.interrupt:
            self._interrupt_all()
        if self.policy.rebalance:
            self._set_cap_phase(after=False)
            self._rebalance("new_version")
        out = self._fill()
        self._fold_counts()
        return out

    def on_instance_failed(self, instance: str) -> list[Action]:
        """``instance`` died: its requests go back to the queue of their version (re-prefill on
        another instance of that version, still C1); nothing is dropped."""
        inst = self.instances.get(instance)
        if inst is None or not inst.alive:
            self.counters.ignored_events += 1
            return []
        self._deactivate(inst)
        inst.alive = False
        self._n_alive -= 1
        for sid in sorted(inst.samples):
            s = self.samples[sid]
            self._unassign(s)
            self._make_pending(s)
        if self.policy.rebalance:
            self._rebalance("failure")
        return self._fill()

    def on_instance_joined(self, instance: str) -> list[Action]:
        """A new (or restarted) instance joins; it is first switched to the newest version."""
        old = self.instances.get(instance)
        if old is not None and old.alive:
            self.counters.ignored_events += 1
            return []
        inst = Instance(instance, version=None)
        self.instances[instance] = inst
        self._n_alive += 1
        self._switch(inst, self.newest)
        return self._fill()

    def on_switch_done(self, instance: str, version: int) -> list[Action]:
        """``instance`` now holds weights ``version`` and accepts requests of it."""
        inst = self.instances.get(instance)
        if inst is None or not inst.alive or inst.target != version:
            self.counters.ignored_events += 1
            return []
        self._incoming[version].discard(instance)
        self._activate(inst, version)
        if self.policy.rebalance:
            self._absorb_overflow(inst)
        return self._fill()

    def on_migration_done(self, sample_id: str, reprefill_tokens: int = 0) -> list[Action]:
        """Optional: a ``Migrate`` completed; a driver that fell back to abort+resubmit reports the
        re-prefilled tokens here."""
        s = self.samples.get(sample_id)
        if s is not None and reprefill_tokens:
            s.reprefill_tokens += reprefill_tokens
            self.counters.reprefill_tokens += reprefill_tokens
        return []

    def on_migration_failed(self, sample_id: str) -> list[Action]:
        """A ``Migrate`` could not be carried out (e.g. the source died before the export): the
        request is queued again for its version and resubmitted (prompt + whatever partial output
        the driver holds) by a ``Submit(resume=...)``. Nothing is dropped."""
        s = self.samples.get(sample_id)
        if s is None or s.state not in (RUNNING, WAITING):
            self.counters.ignored_events += 1
            return []
        if s.state == RUNNING:
            self._unassign(s)
        s.turn_from = None  # (a trajectory that failed between turns runs again from its prompt)
        self._make_pending(s)
        return self._fill()

    def set_prompt_tokens(self, group_id: str, prompt_tokens: int) -> None:
        """Record the prompt length of a dispatched group (for re-prefill accounting); a group
        already consumed (and forgotten) is ignored."""
        g = self.groups.get(group_id)
        if g is not None:
            g.prompt_tokens = prompt_tokens

    def poll(self) -> list[Action]:
        """Re-evaluate dispatch/release without a new event (always safe to call)."""
        return self._fill()

    # ------------------------------------------------------------------ queries

    @property
    def outstanding(self) -> int:
        """Groups dispatched but not yet consumed."""
        return self._total_dispatched - self._total_consumed

    def sample_status(self, sample_id: str) -> dict[str, Any]:
        """State of a sample of an unconsumed group (consumed groups are forgotten: KeyError)."""
        s = self.samples.get(sample_id)
        if s is None:
            raise KeyError(f"{sample_id!r} is unknown or its group was consumed (consumed groups are forgotten)")
        return {"sample_id": s.sample_id, "group_id": s.group_id, "version": s.version,
                "min_version": s.min_version, "max_version": s.max_version, "instance": s.instance,
                "state": s.state, "finished": s.state == FINISHED, "tokens": s.tokens}

    def is_alive(self, instance: str) -> bool:
        """``instance`` is in the pool and has not failed (unknown instances are not alive)."""
        inst = self.instances.get(instance)
        return inst is not None and inst.alive

    def alive_count(self) -> int:
        """How many instances are alive (O(1): kept on every failure and join)."""
        return self._n_alive

    def live_versions(self) -> list[int]:
        """Versions with unconsumed groups, plus the newest weights."""
        return sorted({v for v, n in self._unconsumed.items() if n > 0} | {self.newest})

    def unfinished_by_version(self) -> dict[int, int]:
        return {v: n for v, n in self._unfinished.items() if n > 0}

    def instances_by_version(self) -> dict[int, int]:
        """Current allocation: active plus incoming (switching) instances per version."""
        out: dict[int, int] = {}
        for d in (self._active, self._incoming):
            for v, ids in d.items():
                if ids:
                    out[v] = out.get(v, 0) + len(ids)
        return out

    def cap(self) -> float:
        """Per-instance concurrency cap now in force (inf for the barrier modes)."""
        return self._cap_value

    def _compute_cap(self) -> float:
        if not self.policy.caps:
            return _INF
        return self.config.cap_after_rebalance if self._cap_after else self.config.cap_before_rebalance

    def audit(self) -> int:
        """Check the internal indexes against the records; returns the number of lost groups
        (unconsumed groups with a sample that is neither running, pending nor finished).
        O(outstanding samples): only unconsumed groups are held."""
        lost = set()
        for s in self.samples.values():
            if s.state == RUNNING:
                inst = self.instances.get(s.instance or "")
                ok = inst is not None and inst.alive and s.sample_id in inst.samples
            elif s.state == PENDING:
                ok = s.sample_id in self._pending.get(s.version, {})
            else:
                ok = s.state in (FINISHED, WAITING)
            if not ok:
                lost.add(s.group_id)
        return len(lost)

    def summary(self) -> dict[str, Any]:
        """Counters under the summary.json names (DESIGN section 11)."""
        c = self.counters
        return {
            "mode": self.policy.name, "max_staleness": self.S, "tbs": self.tbs, "rbs": self.policy.rbs,
            "steps": self.next_step, "dispatched_groups": c.dispatched_groups,
            "consumed_groups": c.consumed_groups, "lost_groups": self.audit(),
            "duplicated_groups": c.duplicated_groups, "c1_violations": c.c1_violations,
            "c3_violations": c.c3_violations, "max_consumed_staleness": c.max_consumed_staleness,
            "staleness_histogram": {str(k): v for k, v in sorted(c.staleness_histogram.items())},
            "migrations": c.migrations, "reprefill_tokens": c.reprefill_tokens,
            "interrupts": c.interrupts, "switches": c.switches, "rebalances": c.rebalances,
            "live_versions": len(self.live_versions()), "max_live_versions": c.max_live_versions,
            "workflow_turn_moves": c.workflow_turn_moves, "dual_switches": c.dual_switches,
        }

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, Any]:
        """The full state as a JSON-able dict (checkpoint/resume, simulator inspection); its size
        is O(outstanding work + live versions), not O(history) (see the module docstring)."""
        return {
            "format": _SNAPSHOT_FORMAT,
            "newest": self.newest, "next_step": self.next_step, "trainer_busy": self.trainer_busy,
            "now": self.now, "group_seq": self._group_seq, "cap_after": self._cap_after,
            "last_rebalance": self._last_rebalance, "last_kv_rebalance": self._last_kv_rebalance,
            "counters": {**dataclasses.asdict(self.counters),
                         "staleness_histogram": {str(k): v for k, v in
                                                 self.counters.staleness_histogram.items()}},
            "dispatched_by_version": {str(v): n for v, n in self._dispatched.items()},
            "consumed_by_version": {str(v): n for v, n in self._consumed.items()},
            "groups": [{**dict(zip(_GROUP_FIELDS, _group_values(g))), "sample_ids": list(g.sample_ids)}
                       for g in self.groups.values()],
            "samples": [dict(zip(_SAMPLE_FIELDS, _sample_values(s))) for s in self.samples.values()],
            "instances": [{**dict(zip(_INSTANCE_FIELDS, _instance_values(i))), "samples": sorted(i.samples)}
                          for i in self.instances.values()],
            "finished_order": {str(v): list(d) for v, d in self._finished_groups.items()},
            "pending_order": {str(v): list(d) for v, d in self._pending.items()},
        }

    @classmethod
    def restore(cls, config: OrchestratorConfig, snap: dict[str, Any]) -> "Orchestrator":
        """Rebuild an orchestrator from :meth:`snapshot` output (after a JSON round trip).

        Also reads format 1 (written before consumed groups were forgotten): its per-version
        counts are rebuilt from the full group list, then its consumed groups are dropped."""
        fmt = snap.get("format")
        if fmt not in (1, _SNAPSHOT_FORMAT):
            raise ValueError(f"orchestrator snapshot format {fmt!r} is not supported "
                             f"(this version reads formats 1 and {_SNAPSHOT_FORMAT})")
        self = cls(config, [])
        self.newest, self.next_step = snap["newest"], snap["next_step"]
        self.trainer_busy, self.now = snap["trainer_busy"], snap["now"]
        self._group_seq = snap["group_seq"]
        self._set_cap_phase(bool(snap["cap_after"]))
        self._last_rebalance = snap["last_rebalance"]
        self._last_kv_rebalance = snap.get("last_kv_rebalance")
        cd = dict(snap["counters"])
        cd["staleness_histogram"] = {int(k): v for k, v in cd["staleness_histogram"].items()}
        self.counters = Counters(**cd)
        if fmt != 1:
            self._dispatched = {int(v): n for v, n in snap["dispatched_by_version"].items()}
            self._consumed = {int(v): n for v, n in snap["consumed_by_version"].items()}
        forgotten: set[str] = set()
        for gd in snap["groups"]:
            g = Group(**gd)
            if fmt == 1:
                self._inc(self._dispatched, g.version)
            if g.consumed_step is not None:
                if fmt == 1:
                    self._inc(self._consumed, g.version)
                forgotten.add(g.group_id)
                continue
            self.groups[g.group_id] = g
            self._inc(self._unconsumed, g.version)
        self._total_dispatched = sum(self._dispatched.values())
        self._total_consumed = sum(self._consumed.values())
        for sd in snap["samples"]:
            s = Sample(**sd)
            if s.group_id in forgotten:
                continue
            self.samples[s.sample_id] = s
            if s.state != FINISHED:
                self._inc(self._unfinished, s.version)
        for v, ids in snap["finished_order"].items():
            self._finished_groups[int(v)] = dict.fromkeys(i for i in ids if i not in forgotten)
        for v, ids in snap["pending_order"].items():
            self._pending[int(v)] = dict.fromkeys(ids)
        for s in self.samples.values():
            if s.state == WAITING:  # its trajectory lived in the process that wrote the snapshot: run it again
                s.turn_from = None
                self._make_pending(s)
        for idd in snap["instances"]:
            inst = Instance(**{**idd, "samples": set(idd["samples"])})
            self.instances[inst.instance_id] = inst
            if not inst.alive:
                continue
            self._n_alive += 1
            if inst.tail_version is not None:
                self._inc(self._tail_held, inst.tail_version, inst.tail_left)
            if inst.target is not None:
                self._incoming.setdefault(inst.target, set()).add(inst.instance_id)
            elif inst.version is not None:
                self._active.setdefault(inst.version, set()).add(inst.instance_id)
                self._update_room(inst)
        if fmt == 1:
            self._fold_counts()  # (format 2 holds counts folded at the last step; kept as they are)
        return self

    # ------------------------------------------------------------------ bookkeeping

    def _fold_counts(self) -> None:
        """Merge the per-version dispatched/consumed counts of versions below every version a
        rule can still ask about into one bucket (keyed by the newest folded version).

        Exact: :func:`~.rules.legacy_admits` sums ``dispatched`` over versions ``<= v`` and
        ``consumed`` over versions ``> v`` for a queried ``v`` that is held by an instance (or is
        the newest), and every folded version is below each such ``v``, so both sums are
        unchanged; no instance can later be switched below the floor (switches go to the newest
        version or to one with unconsumed groups, and the oldest unconsumed version only rises).
        Keeps these dicts O(live versions) instead of O(steps)."""
        floor = min((v for d in (self._active, self._incoming) for v, ids in d.items() if ids),
                    default=self.newest)
        floor = min(floor, self.newest, min(self._unconsumed, default=self.newest),
                    min(self._pending, default=self.newest))
        for d in (self._dispatched, self._consumed):
            old = [v for v in d if v < floor]
            if len(old) > 1:
                key = max(old)
                d[key] = sum(d.pop(v) for v in old)

    @staticmethod
    def _inc(d: dict[int, int], k: int, n: int = 1) -> None:
        d[k] = d.get(k, 0) + n

    @staticmethod
    def _dec(d: dict[int, int], k: int, n: int = 1) -> None:
        left = d[k] - n
        if left:
            d[k] = left
        else:
            del d[k]

    def _update_room(self, inst: Instance) -> None:
        """Keep ``_room`` (instances under the cap) and ``_free`` (free slots per version) exact."""
        iid = inst.instance_id
        v = inst.version
        serving = v is not None and inst.alive and inst.target is None
        n = len(inst.samples)
        self._track_busy(iid, v if serving and n else None)
        c = self._cap_int - n if serving else 0
        if c < 0:
            c = 0
        is_over = serving and n > self._cap_int
        ov = self._over_v.get(iid)
        if ov is not None and (not is_over or ov != v):
            self._over[ov].discard(iid)
            del self._over_v[iid]
            ov = None
        if is_over and ov is None:
            self._over.setdefault(v, set()).add(iid)  # type: ignore[arg-type]
            self._over_v[iid] = v  # type: ignore[assignment]
        old = self._contrib.get(iid)
        if old is not None:
            ov, oc = old
            if serving and ov == v:
                if oc != c:
                    self._free[v] += c - oc
                    self._contrib[iid] = (v, c)
                    if c > 0 and oc == 0:
                        self._room.setdefault(v, set()).add(iid)
                    elif c == 0:
                        self._room[v].discard(iid)
                return
            self._free[ov] -= oc
            self._room.get(ov, set()).discard(iid)
            del self._contrib[iid]
        if not serving:
            return
        if c > 0:
            self._room.setdefault(v, set()).add(iid)
        self._free[v] = self._free.get(v, 0) + c
        self._contrib[iid] = (v, c)

    def _track_busy(self, iid: str, version: int | None) -> None:
        """Count ``iid`` as a busy serving instance of ``version`` (None: not counted)."""
        old = self._busy_v.get(iid)
        if old == version:
            return
        if old is not None:
            self._dec(self._busy, old)
            del self._busy_v[iid]
        if version is not None:
            self._inc(self._busy, version)
            self._busy_v[iid] = version

    def _activate(self, inst: Instance, version: int) -> None:
        inst.version = version
        inst.target = None
        self._active.setdefault(version, set()).add(inst.instance_id)
        self._update_room(inst)

    def _deactivate(self, inst: Instance) -> None:
        if inst.target is not None:
            self._incoming.get(inst.target, set()).discard(inst.instance_id)
        if inst.version is not None:
            self._active.get(inst.version, set()).discard(inst.instance_id)
        ov = self._over_v.pop(inst.instance_id, None)
        if ov is not None:
            self._over[ov].discard(inst.instance_id)
        self._track_busy(inst.instance_id, None)
        old_v, old_c = self._contrib.pop(inst.instance_id, (None, 0))
        if old_v is not None:
            self._free[old_v] -= old_c
            self._room.get(old_v, set()).discard(inst.instance_id)

    def _switch(self, inst: Instance, version: int, *, rebalance: bool = False, keep: bool = False) -> None:
        """Emit SwitchVersion; the instance must hold no request, unless ``keep`` (a dual-version
        switch: its requests become the tail of its old version, finished on the old weights).
        ``rebalance``: ordered by a rebalance."""
        kept = None
        if keep:
            assert inst.tail_version is None and inst.version is not None and inst.samples
            kept = inst.tail_version = inst.version
            inst.tail_left = len(inst.samples)
            self._inc(self._tail_held, kept, inst.tail_left)
            self.counters.dual_switches += 1
        else:
            assert not inst.samples, "switching an instance that still holds requests"
        self._deactivate(inst)
        inst.target = version
        self._incoming.setdefault(version, set()).add(inst.instance_id)
        self.counters.switches += 1
        self._out.append(SwitchVersion(inst.instance_id, version, rebalance=rebalance, keep=kept))

    def _set_cap_phase(self, after: bool) -> None:
        if self._cap_after == after:
            return
        self._cap_after = after
        self._cap_value = self._compute_cap()
        self._cap_int = _BIG if self._cap_value == _INF else int(self._cap_value)
        for ids in self._active.values():
            for iid in ids:
                self._update_room(self.instances[iid])

    def _assign(self, s: Sample, inst: Instance) -> None:
        s.instance = inst.instance_id
        s.state = RUNNING
        inst.samples.add(s.sample_id)
        self._update_room(inst)

    def _unassign(self, s: Sample) -> None:
        inst = self.instances[s.instance]  # type: ignore[index]
        inst.samples.discard(s.sample_id)
        s.instance = None
        if inst.tail_version is not None and s.version == inst.tail_version:
            self._dec(self._tail_held, s.version)
            inst.tail_left -= 1
            if inst.tail_left == 0:  # the tail drained: the engine drops its weights
                inst.tail_version = None
        self._update_room(inst)

    def _make_pending(self, s: Sample) -> None:
        s.state = PENDING
        self._pending.setdefault(s.version, {})[s.sample_id] = None

    # ------------------------------------------------------------------ the decision loop

    def _fill(self) -> list[Action]:
        self._try_release()
        if self.policy.rebalance and self._stranded():
            self._rebalance("stranded")
            if self.config.dual_version:
                self._serve_newest_beside_tail()
        self._place_pending()
        if not self.policy.rebalance:
            self._follow_newest()
            self._ensure_instances_for_pending()
            self._place_pending()
        self._supplement()
        if self.policy.rebalance and self.config.legacy_fill:
            self._legacy_fill()
        live = len(self.live_versions())
        if live > self.counters.max_live_versions:
            self.counters.max_live_versions = live
        out, self._out = self._out, []
        return out

    def _unserved(self) -> dict[int, int]:
        """Unfinished requests per version that need an instance of their version: all but those
        finishing as the tail of an instance that serves a newer version."""
        held = self._tail_held
        out = {}
        for v, n in self._unfinished.items():
            n -= held.get(v, 0)
            if n > 0:
                out[v] = n
        return out

    def _serve_newest_beside_tail(self) -> None:
        """``orchestrator.dual_version``: the newest version still has admissible groups and no
        instance after the rebalance (every instance runs requests of an older version, and no
        C1-safe migration can free one: each holds a different version). Switch one to the newest
        now, keeping its requests as the tail of its old version (the engine keeps those weights
        beside the new ones until the tail drains).

        Which instance: one without a tail already (an engine holds at most two weight sets), not
        the last instance of a version with queued requests (they would have none), and of those
        the one with the fewest requests (the shortest tail: least time holding two sets)."""
        if self._active.get(self.newest) or self._incoming.get(self.newest) or self._admissible_new() <= 0:
            return
        best: tuple[int, str] | None = None
        for v, ids in self._active.items():
            if v >= self.newest or (self._pending.get(v) and len(ids) == 1):
                continue
            for iid in ids:
                inst = self.instances[iid]
                if inst.tail_version is None and inst.samples and (best is None or (len(inst.samples), iid) < best):
                    best = (len(inst.samples), iid)
        if best is not None:
            self._switch(self.instances[best[1]], self.newest, keep=True)

    def _stranded(self) -> bool:
        """Work that no instance can serve: queued samples of a version without instances, or
        admissible new groups while no instance holds the newest version."""
        def served(v: int) -> bool:
            return bool(self._active.get(v) or self._incoming.get(v))
        if any(q and not served(v) for v, q in self._pending.items()):
            return True
        return not served(self.newest) and self._admissible_new() > 0

    def _try_release(self) -> None:
        # Only a completed group or a new step can make a batch formable (a dispatch only adds
        # unconsumed groups, which raises the batch_needs bounds), so skip the check otherwise.
        while not self.trainer_busy and self._release_dirty:
            step = self.next_step
            ids = select_batch(step, self.S, self.tbs, self._finished_groups, self._unconsumed)
            if ids is None:
                self._release_dirty = False
                return
            versions = []
            c = self.counters
            for gid in ids:
                g = self.groups.get(gid)
                if g is None or g.consumed_step is not None:  # consumed before (and forgotten)
                    c.duplicated_groups += 1
                    continue
                g.consumed_step = step
                fin = self._finished_groups[g.version]
                del fin[gid]
                if not fin:
                    del self._finished_groups[g.version]
                self._dec(self._unconsumed, g.version)
                self._inc(self._consumed, g.version)
                self._total_consumed += 1
                c.consumed_groups += 1
                lag = step - g.version
                c.staleness_histogram[lag] = c.staleness_histogram.get(lag, 0) + 1
                c.max_consumed_staleness = max(c.max_consumed_staleness, lag)
                if lag > self.S or lag < 0:
                    c.c3_violations += 1
                for sid in g.sample_ids:
                    s = self.samples.pop(sid)  # forgotten with its group (module docstring)
                    if s.min_version != s.max_version:
                        c.c1_violations += 1
                del self.groups[gid]
                versions.append(g.version)
            self._out.append(ReleaseBatch(step, tuple(ids), tuple(versions)))
            self.trainer_busy = True
            self.next_step = step + 1

    def _pick(self, version: int, k: int) -> list[str]:
        """Instances for ``k`` new placements on ``version``: least-loaded first, within the cap
        (barrier modes: no cap). May return fewer than ``k``."""
        cap = self.cap()
        cands = self._room.get(version, set()) if cap != _INF else self._active.get(version, set())
        if not cands or k <= 0:
            return []
        insts = self.instances
        if len(cands) > 4 * k:
            heap = heapq.nsmallest(k, ((insts[i].load, i) for i in cands))
        else:
            heap = [(insts[i].load, i) for i in cands]
        heapq.heapify(heap)
        out = []
        while heap and len(out) < k:
            load, iid = heapq.heappop(heap)
            out.append(iid)
            if load + 1 < cap:
                heapq.heappush(heap, (load + 1, iid))
        return out

    def _group_fits(self, version: int) -> bool:
        """A new group fits when G slots are free on the version's active instances, or, when the
        whole version has fewer than G slots, when all of them are free (never stuck on G > cap)."""
        cap = self.cap()
        n_active = len(self._active.get(version, ()))
        if not n_active:
            return False
        need = self.G if cap == _INF else min(self.G, int(cap) * n_active)
        return self._free_slots(version) >= need

    def _free_slots(self, version: int) -> int:
        """Free slots (cap minus load) over the active instances of ``version``."""
        return self._free.get(version, 0)

    def _place_pending(self) -> None:
        for v in list(self._pending):
            queue = self._pending[v]
            if not queue:
                del self._pending[v]
                continue
            dest = self.newest if self.policy.interrupt else v
            targets = self._pick(dest, len(queue))
            if not targets:
                continue
            for iid, sid in zip(targets, list(queue)):
                del queue[sid]
                self._submit(self.samples[sid], self.instances[iid], dest)
            if not queue:
                del self._pending[v]

    def _submit(self, s: Sample, inst: Instance, version: int) -> None:
        resume = s.tokens > 0
        if s.turn_from is not None:  # the next turn of a trajectory (not a re-tagged one: that one runs again)
            if s.turn_from != inst.instance_id and version == s.version:
                self.counters.workflow_turn_moves += 1
            s.turn_from = None
        if version != s.version:  # partial mode only: re-tag to the weights it continues on
            self._dec(self._unfinished, s.version)
            self._inc(self._unfinished, version)
            s.version = version
            if resume:
                s.max_version = max(s.max_version, version)
            else:
                s.min_version = s.max_version = version
        if resume:
            n = self.groups[s.group_id].prompt_tokens + s.tokens
            s.reprefill_tokens += n
            self.counters.reprefill_tokens += n
        s.submissions += 1
        self._assign(s, inst)
        self._out.append(Submit(s.sample_id, inst.instance_id, version, resume))

    def _create_group(self, version: int) -> None:
        gid = f"g{self._group_seq}"
        sids = [f"{gid}.{i}" for i in range(self.G)]
        g = Group(gid, version, self._group_seq, sids)
        self._group_seq += 1
        self.groups[gid] = g
        pend = self._pending.setdefault(version, {})
        for i, sid in enumerate(sids):
            self.samples[sid] = Sample(sid, gid, i, version, version, version)
            pend[sid] = None
        self._total_dispatched += 1
        self._inc(self._dispatched, version)
        self._inc(self._unconsumed, version)
        self._inc(self._unfinished, version, self.G)
        self.counters.dispatched_groups += 1
        self._out.append(Dispatch(gid, version, tuple(sids)))

    def _admissible_new(self) -> int:
        """How many more groups the admission rule and RBS allow at the newest version."""
        by_window = (self.newest + self.S + 1) * self.tbs - self._total_dispatched
        by_rbs = self.policy.rbs - self.outstanding
        return max(0, min(by_window, by_rbs))

    def _supplement(self) -> None:
        """Tier 1: new groups tagged with the newest version while admission, RBS and capacity
        allow (barrier modes: one whole batch when nothing is outstanding and every instance
        holds the newest version)."""
        v = self.newest
        if self.policy.batch_dispatch:
            if self.outstanding or any(self._pending.values()) or any(self._incoming.values()):
                return
            alive = [i for i in self.instances.values() if i.alive]
            if not alive or any(i.version != v for i in alive):
                return
            n = self._admissible_new()
            for _ in range(n):
                self._create_group(v)
            if n:
                self._place_pending()
            return
        if self._pending.get(v) or not self._group_fits(v):
            return
        n = min(self._admissible_new(), max(1, self._free_slots(v) // self.G))
        assert n == 0 or admits(v, self._total_dispatched + n - 1, self.outstanding + n - 1, self.S, self.tbs,
                                self.policy.rbs)
        for _ in range(n):
            self._create_group(v)
        if n:
            self._place_pending()

    def _legacy_fill(self) -> None:
        """Tier 2 (dora, optional): fill idle slots of legacy instances with groups of their own
        version when the (strict, legacy) admission rule allows."""
        for v in sorted(self._active):
            if v >= self.newest or not self._active[v] or self._pending.get(v):
                continue
            while (self._group_fits(v)
                   and legacy_admits(v, self.newest, self._dispatched, self._consumed, self.outstanding,
                                     self.S, self.tbs, self.policy.rbs)):
                self._create_group(v)
                self._place_pending()

    def _follow_newest(self) -> None:
        """Single-version modes: a drained instance on an older version loads the newest one,
        unless its version still has queued requests."""
        for v in [v for v in self._active if v != self.newest]:
            if self._pending.get(v):
                continue
            for iid in sorted(self._active[v]):
                inst = self.instances[iid]
                if not inst.samples:
                    self._switch(inst, self.newest)

    def _ensure_instances_for_pending(self) -> None:
        """Single-version modes: queued requests of a version no instance holds (after a failure)
        get an idle instance switched back to that version from its snapshot."""
        for v in sorted(self._pending):
            if self.policy.interrupt:
                v_dest = self.newest
            else:
                v_dest = v
            if not self._pending[v] or self._active.get(v_dest) or self._incoming.get(v_dest):
                continue
            idle = [i for i in self.instances.values() if i.alive and not i.samples and not i.switching]
            if not idle:
                return
            self._switch(min(idle, key=lambda i: i.instance_id), v_dest)

    def _interrupt_all(self) -> None:
        """Partial mode at a weight update: interrupt every in-flight request (partial output
        kept by the driver), switch every instance to the newest version; the requests are
        resubmitted (prompt + partial, re-prefill) as instances come back."""
        for iid in sorted(self.instances):
            inst = self.instances[iid]
            if not inst.alive:
                continue
            for sid in sorted(inst.samples):
                s = self.samples[sid]
                self._unassign(s)
                self._make_pending(s)
                self.counters.interrupts += 1
                self._out.append(Interrupt(sid, iid))
            if inst.version != self.newest or inst.switching:
                if inst.target != self.newest:
                    self._switch(inst, self.newest)

    # ------------------------------------------------------------------ dora rebalancer

    def _rebalance(self, trigger: str) -> None:
        """Partition the pool across live versions and move instances/requests (DESIGN sections 4.2-4.3)."""
        self._last_rebalance = self.now
        if trigger in ("timer", "kv", "idle"):
            # two-phase caps: the first load-balancing of a step ends the high-cap phase
            self._set_cap_phase(after=True)
        n_alive, running, idle_versions = self._pool_view()
        if not n_alive:
            return
        adm = self._admissible_new()
        unserved = self._unserved()
        demand: dict[int, float] = {v: float(n) for v, n in unserved.items()}
        required = set(demand)
        if adm > 0:
            demand[self.newest] = demand.get(self.newest, 0.0) + adm * self.G
            required.add(self.newest)
        cur = self.instances_by_version()
        # C-cap: a version keeps at least ceil(unfinished / cap) instances when the pool allows,
        # so a shrinking version's requests fit on its kept instances within the cap
        cap = self._cap_int
        floors = ({v: -(-n // cap) for v, n in unserved.items()} if cap < _BIG else None)
        target = part.partition(n_alive, demand, required, priority=running, floors=floors)
        for v in cur:
            target.setdefault(v, 0)
        if not part.should_apply(cur, target, demand, idle_versions, self.config.imbalance_ratio):
            return
        self.counters.rebalances += 1
        budget = self.config.max_migrations_per_rebalance or None
        # minimum gain (orchestrator.free_into_room); failure recovery (queued requests) is exempt
        into_room = self.config.free_into_room and self._cap_int < _BIG and not any(self._pending.values())
        freed: list[str] = []
        for v in sorted(cur):
            n = cur.get(v, 0) - target.get(v, 0)
            if n <= 0:
                continue
            # (an instance holding a tail keeps its target: it cannot switch again until the tail drains)
            incoming = sorted(i for i in self._incoming.get(v, ()) if self.instances[i].tail_version is None)
            take = incoming[:n]
            n -= len(take)
            active = self._active.get(v, set())
            insts = self.instances
            loads = {iid: len(insts[iid].samples) for iid in active}
            # an instance finishing a tail keeps its weights until the tail drains: not freed
            chosen = plan.choose_to_free({i: n_ for i, n_ in loads.items() if insts[i].tail_version is None}, n)
            if into_room:
                chosen = plan.free_into_room(chosen, loads, self._cap_int)
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
            self._move_all_off(chosen, kept, v)
            freed.extend(take)
            freed.extend(chosen)
        deficits = {v: target[v] - cur.get(v, 0) for v in target if target[v] > cur.get(v, 0)}
        for iid, v in plan.assign_freed(freed, deficits).items():
            self._switch(self.instances[iid], v, rebalance=True)
        log.debug("rebalance(%s): %s -> %s", trigger, cur, target)

    def _pool_view(self) -> tuple[int, list[int], set[int]]:
        """What a rebalance needs of the whole pool: the number of alive instances, the versions
        whose serving instances run requests (oldest first) and the versions with an idle serving
        instance. From the incremental counts (``_n_alive``, ``_busy``): O(versions)."""
        running = sorted(v for v, n in self._busy.items() if n > 0)
        idle = {v for v, ids in self._active.items() if len(ids) > self._busy.get(v, 0)}
        return self._n_alive, running, idle

    def _move_all_off(self, freed: list[str], kept: dict[str, int], version: int) -> None:
        """Every request of the ``freed`` instances goes to the ``kept`` ones (water-filling);
        costs O(kept log kept + moved) and one room update per touched instance.

        Cap policy (keeps C1 and C2, never drops KV): water-filling fills the least-loaded kept
        instances first, so no kept instance is pushed over the cap while the kept room
        suffices; the partition floors (``ceil(unfinished / cap)`` instances per version when the
        pool allows) make it suffice unless some of those instances are still switching in. When
        it does not (pool too small, or kept instances still switching
        in), the overflow is spread evenly *above* the cap rather than re-queued, because a
        re-queued running request loses its KV (re-prefill); the version's instances that finish
        switching take that excess at ``on_switch_done`` (:meth:`_absorb_overflow`), and the
        two-phase cap stops new work landing on them until they are back under it."""
        insts, samples, out = self.instances, self.samples, self._out
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
            chunk = sids[k:k + q]
            insts[dst].samples.update(chunk)
            for sid in chunk:
                samples[sid].instance = dst
            out.extend(map(Migrate, chunk, srcs[k:k + q], itertools.repeat(dst, q), itertools.repeat(version, q)))
            self._update_room(insts[dst])
            k += q
        for iid in freed:
            insts[iid].samples.clear()
            self._update_room(insts[iid])
        self.counters.migrations += len(sids)

    def _bulk_migrate(self, moves: list[tuple[str, str, str]], version: int) -> None:
        """Apply ``(sample, src, dst)`` moves with one room update per touched instance."""
        if not moves:
            return
        insts, samples, out = self.instances, self.samples, self._out
        for dst, chunk in plan.group_by_dst(moves).items():
            sids = [sid for sid, _ in chunk]
            insts[dst].samples.update(sids)
            for sid in sids:
                samples[sid].instance = dst
            out.extend(map(Migrate, sids, [src for _, src in chunk], itertools.repeat(dst),
                           itertools.repeat(version)))
            self._update_room(insts[dst])
        moved_from: dict[str, list[str]] = {}
        for sid, src, _ in moves:
            moved_from.setdefault(src, []).append(sid)
        for src, sids in moved_from.items():
            ss = insts[src].samples
            if len(sids) == len(ss):
                ss.clear()
            else:
                ss.difference_update(sids)
            self._update_room(insts[src])
        self.counters.migrations += len(moves)

    def _absorb_overflow(self, new: Instance) -> None:
        """A version grew: its newly active instance takes the requests its peers hold above the
        cap (most-loaded peer first, shortest requests first), up to the cap and the migration
        budget. Requests within the cap stay where their KV is (locality)."""
        v = new.version
        over = self._over.get(v) if v is not None else None
        if not over:
            return
        room = self._cap_int - len(new.samples)
        budget = self.config.max_migrations_per_rebalance
        if budget:
            room = min(room, budget)
        insts, samples = self.instances, self.samples
        moves: list[tuple[str, str, str]] = []
        for iid in sorted(over, key=lambda i: (-len(insts[i].samples), i)):
            if room <= 0:
                break
            if iid == new.instance_id:
                continue
            src = insts[iid]
            k = min(len(src.samples) - self._cap_int, room)
            if k <= 0:
                continue
            victims = sorted((sid for sid in src.samples if samples[sid].version == v),
                             key=lambda sid: (samples[sid].tokens, sid))[:k]
            moves.extend((sid, iid, new.instance_id) for sid in victims)
            room -= k
        self._bulk_migrate(moves, v)  # type: ignore[arg-type]

    def _level(self, hot: Instance) -> None:
        """KV pressure: move the shortest requests of ``hot`` to the least-loaded peer of the same
        version until their loads are level (locality: only the pressured instance's requests)."""
        v = hot.version
        if v is None or not hot.alive or hot.switching:
            return
        peers = self._active.get(v, set())
        loads = {iid: self.instances[iid].load for iid in peers}
        res = plan.level_within_version(loads, hot.instance_id)
        if res is None:
            return
        dst, count = res
        victims = sorted((sid for sid in hot.samples if self.samples[sid].version == v),
                         key=lambda sid: (self.samples[sid].tokens, sid))[:count]
        self._bulk_migrate([(sid, hot.instance_id, dst) for sid in victims], v)
