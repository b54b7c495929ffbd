"""The orchestrator state machine: events in, actions out, no I/O (DESIGN sections 2-4).

WHY one object for every mode and driver: the runtime (asyncio + HTTP) and the simulator (virtual
clock) must make identical decisions, and the baselines must differ from DORA only by policy, so
every decision lives here and every input arrives as an explicit event. The object never reads a
clock, sleeps, spawns or sends; it only returns actions for the driver to execute in order.

The records (``groups``, ``samples``, ``instances``) live here; the per-version lookup tables over
them live in one :class:`~.index.PoolIndex` (``self.index``) whose methods change a placement and
its tables together, so events cost O(touched samples) and a rebalance costs O(instances + moved
requests), never O(all requests). The mode-specific rules sit beside this module: the dora
rebalancer in :mod:`.rebalance`, the follow-the-newest rules of the other modes in
:mod:`.single_version`, the checkpoint format in :mod:`.snapshot`.

WHY it forgets: a consumed group (and its samples) is dropped at release: its record is the
``ReleaseBatch`` the driver logs (``consumed.jsonl``), and keeping it would make memory, ``audit``
and every checkpoint grow with the run's history. What the rules still need of the past are
counts (groups dispatched / consumed per version, the C1/C2/C3 counters), kept as running
counters; per-version counts of versions no rule can ask about any more are folded into one
bucket. State and snapshot are therefore O(outstanding work + live versions).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import rebalance as dora
from dora_megatron.orchestrator import single_version as single
from dora_megatron.orchestrator import snapshot as snapshots
from dora_megatron.orchestrator.actions import Action, Dispatch, ReleaseBatch, Submit, SwitchVersion
from dora_megatron.orchestrator.host import Counters
from dora_megatron.orchestrator.index import BIG, PoolIndex
from dora_megatron.orchestrator.policy import ModePolicy
from dora_megatron.orchestrator.rules import admits, select_batch
from dora_megatron.types import FINISHED, RUNNING, WAITING, Group, Instance, Sample

log = logging.getLogger(__name__)

_INF = float("inf")


def _cap_of(policy: ModePolicy, config: OrchestratorConfig, after: bool) -> float:
    """Per-instance concurrency cap of a cap phase (inf: the barrier modes have none)."""
    if not policy.caps:
        return _INF
    return config.cap_after_rebalance if after else config.cap_before_rebalance


def _bound(cap: float) -> int:
    """The cap as the index counts it (BIG: uncapped)."""
    return BIG if cap == _INF else int(cap)


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
        self._cap_after = False
        self._cap_value = _cap_of(self.policy, config, after=False)
        self.index = PoolIndex(self.instances, self.samples, _bound(self._cap_value))
        self._last_rebalance: float | None = None
        self._last_kv_rebalance: float | None = None
        # batch release is re-evaluated only when it can have become possible: a group completed,
        # a step ended (new step index, trainer idle) or the state was restored
        self._release_dirty = True
        self._out: list[Action] = []
        for iid in instances:
            if iid in self.instances:
                raise ValueError(f"duplicate instance id {iid!r}")
            self.index.add_instance(Instance(iid, version=0), 0)

    # ------------------------------------------------------------------ events

    def start(self) -> list[Action]:
        """First actions (initial dispatch). Call once after construction."""
        if self.policy.rebalance:
            dora.rebalance(self, "start")
        return self._fill()

    def on_tick(self, now: float) -> list[Action]:
        """Time passes (the driver's clock). Runs the timer-triggered rebalance (dora)."""
        self.now = now
        interval = self.config.rebalance_interval_s
        if (self.policy.rebalance and interval > 0
                and (self._last_rebalance is None or now - self._last_rebalance >= interval)):
            dora.rebalance(self, "timer")
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
        if self.index.finish(s, self.groups[s.group_id]):
            self._release_dirty = True
        if self.policy.rebalance and inst is not None and inst.load == 0 and inst.alive:
            dora.rebalance(self, "idle")
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
        self.index.unassign(s)
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
        if (last is not None and not self.policy.interrupt and not self.index.pending.get(s.version)
                and last.instance_id in self.index.room.get(s.version, ())):
            self._submit(s, last, s.version)
        else:
            self.index.queue(s)
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
                dora.rebalance(self, "kv")
            dora.level(self, inst)
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
            single.interrupt_all(self)
        if self.policy.rebalance:
            self._set_cap_phase(after=False)
            dora.rebalance(self, "new_version")
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
        self.index.fail(inst)
        for sid in sorted(inst.samples):
            s = self.samples[sid]
            self.index.unassign(s)
            self.index.queue(s)
        if self.policy.rebalance:
            dora.rebalance(self, "failure")
        return self._fill()

    def on_instance_joined(self, instance: str) -> list[Action]:
        """A new (or restarted) instance joins; it is first switched to the newest version."""
        old = self.instances.get(instance)
        if old is not None and old.alive:
            self.counters.ignored_events += 1
            return []
        inst = Instance(instance, version=None)
        self.index.add_instance(inst, None)
        self._switch(inst, self.newest)
        return self._fill()

    def on_switch_done(self, instance: str, version: int) -> list[Action]:
        """``instance`` now holds weights ``version`` and accepts requests of it."""
        inst = self.instances.get(instance)
        if inst is None or not inst.alive or inst.target != version:
            self.counters.ignored_events += 1
            return []
        self.index.switched(inst, version)
        if self.policy.rebalance:
            dora.absorb_overflow(self, inst)
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
            self.index.unassign(s)
        s.turn_from = None  # (a trajectory that failed between turns runs again from its prompt)
        self.index.queue(s)
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
        return self.index.total_dispatched - self.index.total_consumed

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
        return self.index.n_alive

    def live_versions(self) -> list[int]:
        """Versions with unconsumed groups, plus the newest weights."""
        return self.index.live_versions(self.newest)

    def unfinished_by_version(self) -> dict[int, int]:
        return {v: n for v, n in self.index.unfinished.items() if n > 0}

    def instances_by_version(self) -> dict[int, int]:
        """Current allocation: active plus incoming (switching) instances per version."""
        return self.index.instances_by_version()

    def cap(self) -> float:
        """Per-instance concurrency cap now in force (inf for the barrier modes)."""
        return self._cap_value

    def audit(self) -> int:
        """The number of lost groups (:meth:`.index.PoolIndex.lost_groups`)."""
        return self.index.lost_groups()

    def summary(self) -> dict[str, Any]:
        """Counters under the summary.json names (DESIGN section 11) where they are summary fields,
        and the orchestrator's own counts beside them."""
        c = self.counters
        return {
            "mode": self.policy.name, "max_staleness": self.S, "tbs": self.tbs, "rbs": self.policy.rbs,
            "steps": self.next_step, "dispatched_groups": c.dispatched_groups,
            "consumed_groups": c.consumed_groups, "lost_groups": self.audit(),
            "duplicate_releases": c.duplicate_releases, "c1_violations": c.c1_violations,
            "c3_violations": c.c3_violations, "max_consumed_staleness": c.max_consumed_staleness,
            "staleness_histogram": {str(k): v for k, v in sorted(c.staleness_histogram.items())},
            "migrations": c.migrations, "reprefill_tokens": c.reprefill_tokens,
            "interrupts": c.interrupts, "switches": c.switches, "rebalances": c.rebalances,
            "live_versions": len(self.live_versions()), "max_live_versions": c.max_live_versions,
            "workflow_turn_moves": c.workflow_turn_moves, "dual_switches": c.dual_switches,
        }

    # ------------------------------------------------------------------ snapshot (:mod:`.snapshot`)

    def snapshot(self) -> dict[str, Any]:
        """The full state as a JSON-able dict (checkpoint/resume, simulator inspection); its size
        is O(outstanding work + live versions), not O(history) (see the module docstring)."""
        return snapshots.snapshot(self)

    @classmethod
    def restore(cls, config: OrchestratorConfig, snap: dict[str, Any]) -> "Orchestrator":
        """Rebuild an orchestrator from :meth:`snapshot` output (after a JSON round trip); its
        lookup tables are rebuilt from the records (:meth:`.index.PoolIndex.rebuild`).

        Only this version's format: a 0.1 project keeps no reader of older checkpoints."""
        self = cls(config, [])
        snapshots.restore_into(self, snap)
        return self

    # ------------------------------------------------------------------ bookkeeping

    def _fold_counts(self) -> None:
        """Fold the per-version counts no rule can ask about any more (:meth:`.index.PoolIndex.fold_counts`)."""
        self.index.fold_counts(self.newest)

    def _set_cap_phase(self, after: bool) -> None:
        """Two-phase caps: ``cap_before_rebalance`` until the first load-balancing of a step."""
        if self._cap_after == after:
            return
        self._cap_after = after
        self._cap_value = _cap_of(self.policy, self.config, after)
        self.index.set_cap(_bound(self._cap_value))

    def _switch(self, inst: Instance, version: int, *, rebalance: bool = False, keep: bool = False) -> None:
        """Emit SwitchVersion; the instance must hold no request, unless ``keep`` (a dual-version
        switch: its requests become the tail of its old version, finished on the old weights).
        ``rebalance``: ordered by a rebalance."""
        kept = self.index.begin_switch(inst, version, keep)
        if keep:
            self.counters.dual_switches += 1
        self.counters.switches += 1
        self._out.append(SwitchVersion(inst.instance_id, version, rebalance=rebalance, keep=kept))

    def _pool_view(self) -> tuple[int, list[int], set[int]]:
        """What a rebalance asks of the whole pool (:meth:`.index.PoolIndex.pool_view`)."""
        return self.index.pool_view()

    # ------------------------------------------------------------------ the decision loop

    def _fill(self) -> list[Action]:
        self._try_release()
        if self.policy.rebalance and dora.stranded(self):
            dora.rebalance(self, "stranded")
            if self.config.dual_version:
                dora.serve_newest_beside_tail(self)
        self._place_pending()
        if not self.policy.rebalance:
            single.follow_newest(self)
            single.ensure_instances_for_pending(self)
            self._place_pending()
        self._supplement()
        if self.policy.rebalance and self.config.legacy_fill:
            dora.legacy_fill(self)
        live = len(self.live_versions())
        if live > self.counters.max_live_versions:
            self.counters.max_live_versions = live
        out, self._out = self._out, []
        return out

    def _try_release(self) -> None:
        # Only a completed group or a new step can make a batch formable (a dispatch only adds
        # unconsumed groups, which raises the batch_needs bounds), so skip the check otherwise.
        ix = self.index
        while not self.trainer_busy and self._release_dirty:
            step = self.next_step
            ids = select_batch(step, self.S, self.tbs, ix.finished_groups, ix.unconsumed)
            if ids is None:
                self._release_dirty = False
                return
            versions = []
            c = self.counters
            for gid in ids:
                g = self.groups.get(gid)
                if g is None or g.consumed_step is not None:  # consumed before (and forgotten)
                    c.duplicate_releases += 1
                    continue
                g.consumed_step = step
                ix.consume(g)
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

    def _place_pending(self) -> None:
        pending = self.index.pending
        for v in list(pending):
            queue = pending[v]
            if not queue:
                del pending[v]
                continue
            dest = self.newest if self.policy.interrupt else v
            targets = self.index.pick(dest, len(queue))
            if not targets:
                continue
            for iid, sid in zip(targets, list(queue)):
                del queue[sid]
                self._submit(self.samples[sid], self.instances[iid], dest)
            if not queue:
                del pending[v]

    def _submit(self, s: Sample, inst: Instance, version: int) -> None:
        resume = s.tokens > 0
        if s.turn_from is not None:  # the next turn of a trajectory (not a re-tagged one: that one runs again)
            if s.turn_from != inst.instance_id and version == s.version:
                self.counters.workflow_turn_moves += 1
            s.turn_from = None
        if version != s.version:  # partial mode only: re-tag to the weights it continues on
            self.index.retag(s, version)
            if resume:
                s.max_version = max(s.max_version, version)
            else:
                s.min_version = s.max_version = version
        if resume:
            n = self.groups[s.group_id].prompt_tokens + s.tokens
            s.reprefill_tokens += n
            self.counters.reprefill_tokens += n
        s.submissions += 1
        self.index.assign(s, inst)
        self._out.append(Submit(s.sample_id, inst.instance_id, version, resume))

    def _create_group(self, version: int) -> None:
        gid = f"g{self._group_seq}"
        sids = [f"{gid}.{i}" for i in range(self.G)]
        g = Group(gid, version, self._group_seq, sids)
        self._group_seq += 1
        self.groups[gid] = g
        self.index.add_group(g, (Sample(sid, gid, i, version, version, version) for i, sid in enumerate(sids)))
        self.counters.dispatched_groups += 1
        self._out.append(Dispatch(gid, version, tuple(sids)))

    def _admissible_new(self) -> int:
        """How many more groups the admission rule and RBS allow at the newest version."""
        by_window = (self.newest + self.S + 1) * self.tbs - self.index.total_dispatched
        by_rbs = self.policy.rbs - self.outstanding
        return max(0, min(by_window, by_rbs))

    def _supplement(self) -> None:
        """Tier 1: new groups tagged with the newest version while admission, RBS and capacity
        allow (barrier modes: one whole batch when nothing is outstanding and every instance
        holds the newest version)."""
        v = self.newest
        ix = self.index
        if self.policy.batch_dispatch:
            if self.outstanding or any(ix.pending.values()) or any(ix.incoming.values()):
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
        if ix.pending.get(v) or not ix.group_fits(v, self.G):
            return
        n = min(self._admissible_new(), max(1, ix.free.get(v, 0) // self.G))
        assert n == 0 or admits(v, ix.total_dispatched + n - 1, self.outstanding + n - 1, self.S, self.tbs,
                                self.policy.rbs)
        for _ in range(n):
            self._create_group(v)
        if n:
            self._place_pending()
