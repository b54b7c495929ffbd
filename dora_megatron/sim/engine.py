"""The simulator's event loop: simulated instances and trainer around the production orchestrator.

WHY this shape: the orchestrator (:class:`dora_megatron.orchestrator.Orchestrator`) is a sans-IO
state machine; the real runtime turns its actions into HTTP calls and feeds back what engines and
the trainer report. Here the *same object* is driven by a virtual clock: every action becomes a
timed effect on a :class:`~dora_megatron.sim.instance.SimInstance` or on the simulated trainer,
and every effect the runtime would report (sample finished, switch done, step finished, instance
stats, clock ticks) becomes the runtime's own event dataclass (``events/event.py``), fed to the
orchestrator through the runtime's mapping (:class:`~dora_megatron.events.EventMapping`):
the simulator is that mapping's executor on a virtual clock. Events are deferred until the current
action list is fully applied, so the driver honours the "execute in order" contract exactly like
the runtime.

Placement (DESIGN section 3; paper section 5.0): *colocated* modes alternate every accelerator
between rollout and training (instances pause while the trainer runs, and the role swap costs
``colocated_switch_s`` each way); *disaggregated* modes train on their own accelerators and push
each new version (``trainer_push_s``); an instance switching version pays ``weight_sync_s``.
With ``elastic_colocation`` the trainer's accelerators serve as extra rollout instances while the
trainer waits for data; when training starts they leave (``on_instance_failed``: their requests go
back to the orchestrator and are resubmitted to same-version instances; the simulator moves their
KV instead of re-prefilling) and rejoin (``on_instance_joined``) when the trainer next waits.

The driver also *checks* the orchestrator independently (:mod:`.checks`): every released batch
must hold TBS complete groups never consumed before (C2) within the staleness bound (C3), every
consumed sample's tokens must come from one version (C1; partial mode breaks it by design), and no
batch may be released after the run's last step (exactly TBS groups consumed per trained step).

One job per module: this one is the executor (each action's effect on the simulated instances and
requests) and the run; the virtual clock and its loop are :mod:`.clock`, the mapping's bookkeeping
hooks :mod:`.hooks`, the engines' reports (stats, progress, ticks) :mod:`.polls`, the trainer
:mod:`.trainer`, elastic colocation :mod:`.elastic`, the result, the plots' series and the
orchestrator's profile :mod:`.report`.

Multi-turn workloads (``workload.turns``): a sample's turns run on an instance like requests; when a
turn ends with a tool call the request leaves the instance (its slot and its KV are freed: the
instance admits other work while the tool runs) and the orchestrator hears it as the runtime's
workflows report it (:class:`~dora_megatron.events.TurnEnded`: the slot is the
orchestrator's to give away). When the tool's latency has passed it asks for the next turn
(:class:`~dora_megatron.events.TurnReady`) and the orchestrator places it on its version: back
on the instance of its last turn, which prefills only the tool's result (the engine's prefix cache,
SGLang's radix cache, still holds the trajectory's context: a tool call is seconds and a finished
request's KV is kept until memory is needed; eviction is not modelled), or on another instance (a
move between turns, ``workflow_turn_moves``), which prefills the whole context (counted as
re-prefilled tokens). An interrupted trajectory, or one whose next turn partial mode re-tags to new
weights, is run again from its prompt, as the runtime runs a workflow again, so C1 holds for
trajectories in every mode.
"""

from __future__ import annotations

import time as _time
from collections import deque
from typing import Any, Callable

from dora_megatron.config.sim import SimConfig
from dora_megatron.events import (EngineReply, Event, EventMapping, MigrationDone, Start, SwitchDone, TrainerDone,
                                  TurnEnded, TurnReady)
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.orchestrator.actions import Dispatch, Interrupt, Migrate, ReleaseBatch, Submit, SwitchVersion, perform
from dora_megatron.sim.checks import GroupState, ReleaseChecks, SimProtocolError
from dora_megatron.sim.clock import ARRIVE, SWITCH_DONE, TOOL_DONE, TRAIN_DONE, WAKE, VirtualClock
from dora_megatron.sim.cost import DecodeModel, kv_transfer_s
from dora_megatron.sim.elastic import ElasticColocation
from dora_megatron.sim.events import EventQueue
from dora_megatron.sim.hooks import MappingHooks
from dora_megatron.sim.instance import PAUSED, READY, SWITCHING, SimInstance, SimRequest
from dora_megatron.sim.polls import EnginePolls
from dora_megatron.sim.report import OrchestratorProfile, RowSink, SimResult, StepExtras, build_result
from dora_megatron.sim.trainer import SimTrainer
from dora_megatron.sim.workload import Workload


class Simulation:
    """One run of one mode. ``Simulation(cfg).run()`` -> :class:`SimResult`."""

    def __init__(self, cfg: SimConfig, orchestrator_factory: Callable[..., Any] | None = None) -> None:
        from dora_megatron.orchestrator import Orchestrator

        self.cfg = cfg
        self.ocfg = cfg.orchestrator_config()
        self.mode = self.ocfg.mode
        self.S = self.ocfg.effective_staleness
        self.cost = cfg.cost
        self.record_timeline = cfg.sim.timeline
        # request slots per instance for the utilization metric: the engine's physical cap, or the
        # orchestrator's (higher, first-phase) cap when that is lower; the same for every mode
        self.slot_cap = min(cfg.cost.max_concurrent, self.ocfg.cap_before_rebalance)
        self.placement = cfg.cluster.placement(self.mode)
        self.colocated = self.placement == "colocated"
        decode = DecodeModel.from_config(cfg.cost, cfg.rollout)
        self.decode_model = decode
        n = cfg.cluster.rollout_instances(self.mode)
        n_el = cfg.cluster.elastic_instances(self.mode)
        self.instances: dict[str, SimInstance] = {}
        for i in range(n):
            iid = f"r{i}"
            self.instances[iid] = SimInstance(iid, 0, cfg.cost, decode)
        elastic_ids = [f"e{i}" for i in range(n_el)]
        for iid in elastic_ids:
            inst = SimInstance(iid, 0, cfg.cost, decode)
            inst.state = PAUSED
            self.instances[iid] = inst
        self.rollout_ids = [f"r{i}" for i in range(n)]
        self.workload = Workload(cfg.workload, self.ocfg.group_size)
        self.q = EventQueue()
        self.clock = VirtualClock(self.q, cfg.sim.poll_interval_s, cfg.sim.max_sim_time_s)
        factory = orchestrator_factory or Orchestrator
        # elastic instances are not in the pool until the trainer first waits
        self.orch = factory(self.ocfg, list(self.rollout_ids))
        self.mapping = EventMapping(self.orch, MappingHooks(self))  # the runtime's: events -> orchestrator calls
        self.elastic = ElasticColocation(self, elastic_ids)
        self.polls = EnginePolls(self, self.ocfg.kv_high_watermark, cfg.sim.stats_interval_s, cfg.sim.poll_interval_s)
        # sample / group bookkeeping
        self.groups: dict[str, GroupState] = {}
        self.reqs: dict[str, SimRequest] = {}
        self.where: dict[str, str] = {}  # sid -> instance id (running or queued there)
        self.held: dict[str, tuple[SimRequest, bool]] = {}  # off-instance partial state; bool: KV kept
        self.transit: dict[str, tuple[SimRequest, str]] = {}  # sid -> (req, dst)
        #: multi-turn, between two turns (its tool running, or its next turn waiting for the
        #: orchestrator's Submit): sid -> (req, the instance of its last turn, whether that
        #: instance's prefix cache still holds the trajectory's context)
        self.tooling: dict[str, tuple[SimRequest, str, bool]] = {}
        self.turn_ready: set[str] = set()  # those of them whose tool has returned
        #: sid -> the number of its running tool call (a run-again trajectory's earlier call is stale)
        self.tool_calls: dict[str, int] = {}
        self._tool_seq = 0
        self.finished_ids: set[str] = set()
        self.trainer = SimTrainer()
        #: sample id -> the versions that produced its tokens, once it crossed one (partial mode)
        self.spans: dict[str, set[int]] = {}
        #: what happened, in order, for after the action list being applied: events for the
        #: orchestrator, or the simulator's own deferred steps (callables)
        self._notes: deque[Event | Callable[[], None]] = deque()
        self.window_start: float | None = 0.0 if cfg.sim.warmup_steps == 0 else None
        # accounting: every metric comes from the recorder's events (observability/recorder.py)
        self.step_rows: list[dict[str, Any]] = []
        self.metrics = MetricsRecorder(slots_per_instance=self.slot_cap, rebalancer=self.orch.policy.rebalance,
                                       warmup_steps=cfg.sim.warmup_steps, sinks=[RowSink(self.step_rows)])
        self._busy_seen = 0.0  # the instance models' busy slot-seconds already reported
        #: what the plots draw of each trained step beyond its StepRecord (the series are a view of
        #: both, built once at the end: sim/report.py::series_of)
        self.step_extras: list[StepExtras] = []
        self.checks = ReleaseChecks(cfg.sim.steps, self.ocfg.tbs, self.S)
        # the summary's migrations / reprefill_tokens are the orchestrator's counters, as in dora
        # train; these are the simulator's own records of what its instances did
        self.migrations_in_window = 0  # moves carried out inside the measurement window
        self.migration_s_in_window = 0.0  # request-seconds in KV transfer inside the window (migration_fraction)
        #: KV bytes moved by Migrate actions over the whole run (dora train's Migrations.migrated_bytes)
        self.migrated_bytes = 0.0
        self.elastic_kv_bytes = 0.0  # KV carried back with requests of departed elastic instances (no Migrate)
        #: tokens the simulated instances prefilled again (resumed requests, moves by re-prefill, next
        #: turns placed on another instance), whole run; the orchestrator's reprefill_tokens does not
        #: see a next turn's prefill
        self.sim_reprefill_tokens = 0
        self.switch_s_total = 0.0  # instance-seconds spent loading weights (window)
        self.dual_switches = 0  # SwitchVersion actions that kept the old version's tail
        self.profile = OrchestratorProfile()
        # cost.rebalance_overhead_s owed by the actions being applied (set while applying the
        # actions of an orchestrator call that ran a rebalance)
        self._rebalance_overhead_s = 0.0
        self.deadlock = False

    # ================================================================== orchestrator calls
    def _feed(self, event: Event) -> None:
        """``event`` through the runtime's mapping, timed (the orchestrator's share of the run), then
        its actions applied."""
        counters = self.orch.counters
        actions, rebalances = self.profile.timed(lambda: self.mapping.feed(event), lambda: counters.rebalances)
        # a rebalance's fixed control-plane cost (cost.rebalance_overhead_s): the switches and KV
        # transfers it ordered start only after it
        self._rebalance_overhead_s = rebalances * self.cost.rebalance_overhead_s
        try:
            self.mapping.act(actions)
        finally:
            self._rebalance_overhead_s = 0.0

    def _note(self, item: Event | Callable[[], None]) -> None:
        self._notes.append(item)

    def step_boundary(self) -> bool:
        """The run's last step ended (the mapping then does not tell the orchestrator: sim/hooks.py)."""
        return self.trainer.steps_done >= self.cfg.sim.steps

    # ================================================================== actions
    def execute(self, actions: list[Any]) -> None:
        """The simulator is an :class:`~dora_megatron.orchestrator.ActionHandler`: one method per action."""
        try:
            perform(self, actions)
        except TypeError as err:
            if str(err).startswith("unknown action"):
                raise SimProtocolError(str(err)) from err
            raise

    def dispatch(self, a: Dispatch) -> None:
        now = self.q.now
        index = len(self.groups)
        spec = self.workload.group(index, a.version)
        if len(a.sample_ids) != len(spec.response_tokens):
            raise SimProtocolError(f"group {a.group_id} has {len(a.sample_ids)} samples, G={len(spec.response_tokens)}")
        self.groups[a.group_id] = GroupState(spec, a.version, tuple(a.sample_ids), dispatch_s=now)
        for i, (sid, target) in enumerate(zip(a.sample_ids, spec.response_tokens)):
            ends = spec.turn_ends[i] if spec.turn_ends else ()
            self.reqs[sid] = SimRequest(sid, a.group_id, a.version, spec.prompt_tokens, target, turn_ends=ends)

    def _inst(self, iid: str) -> SimInstance:
        inst = self.instances.get(iid)
        if inst is None:
            raise SimProtocolError(f"unknown instance {iid}")
        return inst

    def _sync(self, inst: SimInstance, wake: bool = False) -> None:
        for req in inst.sync(self.q.now, wake):
            self._complete(req, inst)

    def _touch(self, inst: SimInstance) -> None:
        inst.fill_from_queue(self.q.now)
        inst.epoch += 1
        w = inst.next_wake()
        if w is not None:
            self.q.push(w, WAKE, (inst.iid, inst.epoch))
        inst.mark(self.q.now, self.record_timeline)

    def _place(self, req: SimRequest, inst: SimInstance, prefill_tokens: int, arriving: bool = False) -> None:
        # (a move that was under way when its destination was switched keeping its version joins the tail)
        joins_tail = arriving and req.version == inst.tail_version
        if not joins_tail and (inst.state == SWITCHING or inst.version != req.version):
            raise SimProtocolError(f"{req.sample_id} (version {req.version}) sent to {inst.iid} holding "
                                   f"version {inst.version} ({inst.state})")
        self.where[req.sample_id] = inst.iid
        inst.add(req, self.q.now, prefill_tokens)

    def submit(self, a: Submit) -> None:
        inst = self._inst(a.instance)
        req = self.reqs.get(a.sample_id)
        if req is None:
            raise SimProtocolError(f"submit of unknown sample {a.sample_id}")
        kv_kept = False
        if a.sample_id in self.tooling:
            self._next_turn(a, inst)
            return
        if a.sample_id in self.held:
            req, kv_kept = self.held.pop(a.sample_id)
        elif a.sample_id in self.finished_ids:
            return  # finished in the same instant; its finish note is queued
        elif a.sample_id in self.where or a.sample_id in self.transit:
            raise SimProtocolError(f"submit of {a.sample_id} which is already placed or finished")
        if a.version != req.version:
            if req.generated > 0:
                # partial mode: tokens from more than one version (C1 broken); the orchestrator
                # hears it with the answer, as the runtime's engines say it, and alone counts it
                self.spans.setdefault(a.sample_id, set()).update((req.version, a.version))
            req.version = a.version
        self._sync(inst)
        if kv_kept and req.generated > 0 and inst.version == req.version:
            # elastic return: the KV travels with the request instead of being recomputed
            self._start_transfer(req, inst, counted_as_migration=False)
        else:
            prefill = req.context
            if req.generated > 0:
                self.sim_reprefill_tokens += prefill
            self._place(req, inst, prefill)
            self._touch(inst)

    def _next_turn(self, a: Submit, inst: SimInstance) -> None:
        """The orchestrator placed a trajectory's next turn: on the instance of its last turn the
        prefix is cached and only the tool's result is prefilled; elsewhere the whole context is."""
        if a.sample_id not in self.turn_ready:
            raise SimProtocolError(f"submit of {a.sample_id} while its tool runs")
        self.turn_ready.discard(a.sample_id)
        req, last, cached = self.tooling.pop(a.sample_id)
        if a.version != req.version:
            # partial mode re-tags it to new weights: run again from its prompt (C1 per trajectory)
            req.restart()
            req.version = a.version
            prefill = req.context
        elif a.instance == last and cached:
            prefill = self.cfg.workload.tool_result_tokens
        else:
            prefill = req.context
            self.sim_reprefill_tokens += prefill
        self._sync(inst)
        self._place(req, inst, prefill)
        self._touch(inst)

    def _start_transfer(self, req: SimRequest, dst: SimInstance, counted_as_migration: bool = True) -> None:
        dt = kv_transfer_s(self.cost, req.context) + (self._rebalance_overhead_s if counted_as_migration else 0.0)
        self.transit[req.sample_id] = (req, dst.iid)
        moved = req.context * self.cost.kv_bytes_per_token
        if counted_as_migration:
            self.migrated_bytes += moved  # over the whole run, as dora train counts an exported request's KV
        else:
            self.elastic_kv_bytes += moved
        if self._in_window():
            self.migrations_in_window += 1 if counted_as_migration else 0
            self.migration_s_in_window += dt
        self.q.push(self.q.now + dt, ARRIVE, req.sample_id)

    def _take(self, sid: str, iid: str) -> SimRequest | None:
        """Remove a sample from wherever the simulator holds it (instance, queue or transit)."""
        if sid in self.transit:
            req, _ = self.transit.pop(sid)
            return req
        inst = self._inst(iid)
        if self.where.get(sid) != iid:
            raise SimProtocolError(f"{sid} is not on {iid} (it is on {self.where.get(sid)})")
        self._sync(inst)
        if sid in self.finished_ids:
            return None  # it completed at the sync; its finish note is queued, nothing to move
        req = inst.take(sid, self.q.now)
        del self.where[sid]
        self._touch(inst)
        return req

    def migrate(self, a: Migrate) -> None:
        if a.sample_id in self.finished_ids:
            return  # finished in the same instant (its finish note is queued); nothing to move
        dst = self._inst(a.dst)
        if a.sample_id in self.tooling:
            self._migrate_turn_ended(a)
            return
        req = self._take(a.sample_id, a.src)
        if req is None:
            return
        if req.version != a.version or dst.version != a.version or dst.state == SWITCHING:
            raise SimProtocolError(f"migrate {a.sample_id} v{req.version} to {a.dst} holding v{dst.version} ({dst.state})")
        if self.cost.reprefill_on_migrate or req.generated == 0:
            prefill = req.context
            if req.generated > 0:
                self.sim_reprefill_tokens += prefill
                self._note(MigrationDone(a.sample_id, prefill))
            if self._in_window():
                self.migrations_in_window += 1
            self._sync(dst)
            self._place(req, dst, prefill)
            self._touch(dst)
        else:
            self._start_transfer(req, dst)

    def _migrate_turn_ended(self, a: Migrate) -> None:
        """A move of a trajectory whose turn ended in the same instant (its TurnEnded is queued):
        nothing is on an instance to move. The orchestrator counts it on ``a.dst`` until it hears
        the turn's end, so ``a.dst`` is the last instance it knows; that one holds none of its context."""
        req, last, _ = self.tooling[a.sample_id]
        if last != a.src or a.sample_id in self.turn_ready:
            raise SimProtocolError(f"migrate of {a.sample_id} between two turns (last turn on {last}) from {a.src}")
        self.tooling[a.sample_id] = (req, a.dst, False)

    def interrupt(self, a: Interrupt) -> None:
        if a.sample_id in self.finished_ids:
            return
        if a.sample_id in self.tooling:
            # its turn ended in the same instant (its TurnEnded is queued, then dropped: not current)
            if a.sample_id in self.turn_ready:
                raise SimProtocolError(f"interrupt of {a.sample_id} between two turns: it is on no instance")
            req, _, _ = self.tooling.pop(a.sample_id)
            self.tool_calls.pop(a.sample_id, None)
        else:
            req = self._take(a.sample_id, a.instance)
        if req is None:
            return
        if req.turn_ends:
            req.restart()  # a trajectory is run again from its prompt (no tokens of two versions)
        self.held[a.sample_id] = (req, False)

    def switch_version(self, a: SwitchVersion) -> None:
        inst = self._inst(a.instance)
        self._sync(inst)
        if a.keep is not None:
            # dual version: its requests finish on the kept weights; decoding stalls while it loads
            if a.keep != inst.version or inst.tail_version is not None or inst.state == SWITCHING:
                raise SimProtocolError(f"dual switch of {a.instance} keeping v{a.keep}: it holds v{inst.version} "
                                       f"(tail v{inst.tail_version}, {inst.state})")
            inst.keep_tail(self.q.now, arriving=sum(1 for _, dst in self.transit.values() if dst == inst.iid))
            self.dual_switches += 1
        elif inst.running or inst.queue:
            raise SimProtocolError(f"switch of {a.instance} while it holds {inst.load} requests")
        if self.colocated:
            dt = 0.0  # weights are resharded in place; the swap cost is on the trainer's timeline
        elif a.instance in self.elastic.ids:
            dt = self.cost.colocated_switch_s  # the trainer's own accelerators hold the newest weights
        else:
            dt = self.cost.weight_sync_s()
        dt += self._rebalance_overhead_s
        inst.state = SWITCHING
        inst.epoch += 1
        inst.mark(self.q.now, self.record_timeline)
        if self._in_window():
            self.switch_s_total += dt
        self.metrics.weight_sync_started(a.instance, self.q.now, rebalance=a.rebalance)
        inst.switch_seq += 1
        self.q.push(self.q.now + dt, SWITCH_DONE, (a.instance, a.version, inst.switch_seq, self.q.now))

    def release_batch(self, a: ReleaseBatch) -> None:
        now = self.q.now
        fresh = self.checks.release(a, self.groups, self.trainer.busy)
        if self.colocated:
            for inst in self.instances.values():
                self._sync(inst)
                inst.pause(now)
                inst.epoch += 1
                inst.mark(now, self.record_timeline)
            sync_s = 2 * self.cost.colocated_switch_s
        else:
            sync_s = self.cost.trainer_push_s
            if self.elastic.in_pool:
                sync_s += self.cost.colocated_switch_s
                self.elastic.leave()
        gpus = self.cfg.cluster.trainer_gpu_count(self.mode)
        end = self.trainer.start(a, fresh, now, lambda tokens: self.cost.train_s(tokens, gpus), sync_s)
        self.q.push(end, TRAIN_DONE, a.step)

    # ================================================================== events
    def _complete(self, req: SimRequest, inst: SimInstance) -> None:
        sid = req.sample_id
        self.where.pop(sid, None)
        if req.generated < req.target_tokens:  # a turn ended with a tool call: off the instance while it runs
            g = self.groups[req.group_id]
            latency = g.spec.tool_s[g.sample_ids.index(sid)][req.turn]
            self.tooling[sid] = (req, inst.iid, True)
            self._tool_seq += 1
            self.tool_calls[sid] = self._tool_seq
            self.q.push(self.q.now + latency, TOOL_DONE, (sid, self._tool_seq))
            self._note(TurnEnded(sid, req.turn))
            return
        self.finished_ids.add(sid)
        g = self.groups[req.group_id]
        if req.turn_ends:
            tools = g.spec.tool_s[g.sample_ids.index(sid)]
            self.metrics.trajectory_finished(TrajectoryStats(
                turns=len(req.turn_ends), model_tokens=req.generated, tool_calls=len(tools),
                well_formed_calls=len(tools), tool_latency_s=sum(tools)))
        g.finished += 1
        if g.finished == len(g.sample_ids):
            g.complete_s = self.q.now
        self.clock.progressed()
        self._note(EngineReply(sid, inst.iid, req.generated, start=g.dispatch_s, end=self.q.now))

    def _on_wake(self, payload: tuple[str, int]) -> None:
        iid, epoch = payload
        inst = self.instances[iid]
        if epoch != inst.epoch:
            return
        self._sync(inst, wake=True)
        self._touch(inst)

    def _on_switch_done(self, payload: tuple[str, int, int, float]) -> None:
        iid, version, seq, start = payload
        inst = self.instances[iid]
        if inst.state != SWITCHING or seq != inst.switch_seq:
            return  # an elastic instance that left (and maybe rejoined) meanwhile
        self.metrics.weight_sync_finished(iid, self.q.now)
        inst.version = version
        inst.state = PAUSED if (self.colocated and self.trainer.busy) else READY
        inst.t0 = self.q.now
        inst.epoch += 1
        inst.mark(self.q.now, self.record_timeline)
        if inst.running:
            self._touch(inst)  # its kept tail decodes on
        self._note(SwitchDone(iid, version, engine=None, start=start, end=self.q.now))

    def _on_tool_done(self, payload: tuple[str, int]) -> None:
        """The tool of ``sid``'s turn ended: its result joins the context and the trajectory asks
        for its next turn (the orchestrator places it: :meth:`_next_turn`)."""
        sid, call = payload
        entry = self.tooling.get(sid)
        if entry is None or self.tool_calls.get(sid) != call:
            return  # run again meanwhile (and maybe already on its next attempt)
        del self.tool_calls[sid]
        req = entry[0]
        req.turn += 1
        req.env_tokens += self.cfg.workload.tool_result_tokens
        self.turn_ready.add(sid)
        self._note(TurnReady(sid, req.turn))

    def _on_arrive(self, sid: str) -> None:
        entry = self.transit.pop(sid, None)
        if entry is None:
            return  # interrupted or re-routed while in transit
        req, dst_id = entry
        dst = self.instances[dst_id]
        self._sync(dst)
        self._place(req, dst, 0, arriving=True)
        self._touch(dst)

    def _on_train_done(self, step: int) -> None:
        now = self.q.now
        cur = self.trainer.finish(now)
        # the trainer pushes (or swaps roles) after computing: the step's last sync_s seconds
        self.metrics.trainer_sync(now - cur.sync_s, now)
        busy = sum(inst.occupied_slot_s(now) for inst in self.instances.values())
        oc = self.orch.counters  # the run totals so far, as dora train's step record takes them
        self.metrics.busy_slot_seconds(busy - self._busy_seen)
        self._busy_seen = busy
        self.metrics.step_trained(step, end_s=now, wait_s=cur.wait_s, train_s=cur.train_s, tokens=cur.tokens,
                                  staleness=cur.staleness, rewards=(), response_lengths=cur.lengths,
                                  live_versions=len(self.orch.live_versions()), migrations=oc.migrations,
                                  migrated_kv_bytes=self.migrated_bytes, reprefill_tokens=oc.reprefill_tokens,
                                  groups=cur.groups, versions=cur.versions)
        self.step_extras.append(StepExtras.of(cur, len(self.orch.live_versions()), self.orch.instances_by_version()))
        self.clock.progressed()
        if self.trainer.steps_done == self.cfg.sim.warmup_steps and self.window_start is None:
            self._open_window(now)
        if self.colocated:
            for inst in self.instances.values():
                if inst.state == PAUSED:
                    inst.resume(now)
                    inst.epoch += 1
                    self._touch(inst)
        if self.mode == "partial" and not self.step_boundary():
            self.polls.report_progress(self.polls.in_flight())
        # the run's last step ends the run in the mapping (step_boundary): the orchestrator does
        # not hear of it, so it cannot release a batch nobody will train
        self._note(TrainerDone(step, {"version": step + 1}, start=now - cur.train_s - cur.sync_s,
                               train_s=cur.train_s, batch=None))
        self._note(self._maybe_elastic_join)

    def _maybe_elastic_join(self) -> None:
        self.elastic.maybe_join(self.trainer.busy, self.trainer.steps_done < self.cfg.sim.steps)

    # ================================================================== helpers
    def _in_window(self) -> bool:
        return self.window_start is not None

    def _open_window(self, now: float) -> None:
        self.window_start = now
        self._busy_seen = 0.0  # the instance models count from the window's start on
        self.switch_s_total = 0.0
        self.migration_s_in_window = 0.0
        for inst in self.instances.values():
            inst.busy_slot_s = 0.0
            inst.window_start = now

    def _drain(self) -> None:
        while self._notes:
            item = self._notes.popleft()
            if callable(item):
                item()
            else:
                self._feed(item)

    # ================================================================== run
    def run(self) -> SimResult:
        wall0 = _time.perf_counter()
        cfg = self.cfg
        for inst in self.instances.values():
            inst.mark(0.0, self.record_timeline)
        for iid in self.rollout_ids:
            self.metrics.instance_joined(iid, 0.0)
        self._feed(Start())
        self._drain()
        self._maybe_elastic_join()
        self._drain()
        handlers = {WAKE: self._on_wake, SWITCH_DONE: self._on_switch_done, ARRIVE: self._on_arrive,
                    TRAIN_DONE: self._on_train_done, TOOL_DONE: self._on_tool_done}
        self.deadlock = self.clock.run(
            handlers, self.polls.poll, self._drain, done=lambda: self.trainer.steps_done >= cfg.sim.steps,
            idle=lambda: not self.trainer.busy and not (any(i.running or i.queue for i in self.instances.values())
                                                        or self.transit or self.tooling))
        end = self.q.now
        for inst in self.instances.values():
            inst.close_timeline(end)
        return build_result(self, end, _time.perf_counter() - wall0)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation of ``cfg`` (its ``orchestrator.mode``)."""
    return Simulation(cfg).run()
