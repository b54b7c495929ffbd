"""The simulator's event loop: simulated instances and trainer around the production orchestrator.

WHY this shape: the orchestrator (:class:`dora_megatron.orchestrator.Orchestrator`) is a sans-IO
state machine; the real runtime turns its actions into HTTP calls and feeds back what engines and
the trainer report. Here the *same object* is driven by a virtual clock: every action becomes a
timed effect on a :class:`~dora_megatron.sim.instance.SimInstance` or on the simulated trainer,
and every effect the runtime would report (sample finished, switch done, step finished, instance
stats, clock ticks) becomes the runtime's own event dataclass (``controller/loop.py``), fed to the
orchestrator through the runtime's mapping (:class:`~dora_megatron.controller.loop.EventMapping`):
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

The driver also *checks* the orchestrator independently: every released batch must hold TBS
complete groups never consumed before (C2) within the staleness bound (C3), every consumed
sample's tokens must come from one version (C1; partial mode breaks it by design), and no batch may
be released after the run's last step (exactly TBS groups consumed per trained step).

Multi-turn workloads (``workload.turns``): a sample's turns run on an instance like requests; when a
turn ends with a tool call the request leaves the instance (its slot and its KV are freed: the
instance admits other work while the tool runs) and the orchestrator hears it as the runtime's
workflows report it (:class:`~dora_megatron.controller.loop.TurnEnded`: the slot is the
orchestrator's to give away). When the tool's latency has passed it asks for the next turn
(:class:`~dora_megatron.controller.loop.TurnReady`) and the orchestrator places it on its version: back
on the instance of its last turn, which prefills only the tool's result (the engine's prefix cache,
SGLang's radix cache, still holds the trajectory's context: a tool call is seconds and a finished
request's KV is kept until memory is needed; eviction is not modelled), or on another instance (a
move between turns, ``workflow_turn_moves``), which prefills the whole context (counted as
re-prefilled tokens). An interrupted trajectory, or one whose next turn partial mode re-tags to new
weights, is run again from its prompt, as the runtime runs a workflow again, so C1 holds for
trajectories in every mode.
"""

from __future__ import annotations

import json
import logging
import time as _time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dora_megatron.config.sim import SimConfig
from dora_megatron.controller.loop import (EngineReply, Event, EventMapping, InstanceFailed, InstanceJoined,
                                           InstanceStats, MigrationDone, SampleProgress, Start, SwitchDone, Tick,
                                           TrainerDone, TurnEnded, TurnReady)
from dora_megatron.sim.cost import DecodeModel, kv_transfer_s
from dora_megatron.sim.events import EventQueue
from dora_megatron.sim.instance import PAUSED, READY, SWITCHING, SimInstance, SimRequest
from dora_megatron.orchestrator.actions import Dispatch, Interrupt, Migrate, ReleaseBatch, Submit, SwitchVersion, perform
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.summary import RunTotals
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.sim.workload import GroupSpec, Workload

log = logging.getLogger(__name__)

WAKE, SWITCH_DONE, ARRIVE, TRAIN_DONE, POLL, TOOL_DONE = "wake", "switch_done", "arrive", "train_done", "poll", "tool"


class SimProtocolError(RuntimeError):
    """The orchestrator asked for something a real engine would refuse (a bug to fix)."""


@dataclass
class _GroupState:
    spec: GroupSpec
    version: int
    sample_ids: tuple[str, ...]
    finished: int = 0
    consumed: int = 0
    dispatch_s: float = 0.0
    complete_s: float | None = None


@dataclass
class _Trainer:
    busy: bool = False
    idle_since: float = 0.0
    steps_done: int = 0
    current: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimResult:
    """What one simulation produced: the DESIGN section 11 summary plus series for plots."""

    summary: dict[str, Any]
    series: dict[str, list[Any]]
    timeline: list[tuple[str, float, float, int | None, str]]
    extra: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)  # the steps.jsonl rows (same keys as dora train)

    def to_json(self) -> dict[str, Any]:
        return {**self.summary, "series": self.series, "extra": self.extra}


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
        self.elastic_ids = [f"e{i}" for i in range(n_el)]
        for iid in self.elastic_ids:
            inst = SimInstance(iid, 0, cfg.cost, decode)
            inst.state = PAUSED
            self.instances[iid] = inst
        self.rollout_ids = [f"r{i}" for i in range(n)]
        self.workload = Workload(cfg.workload, self.ocfg.group_size)
        self.q = EventQueue()
        factory = orchestrator_factory or Orchestrator
        # elastic instances are not in the pool until the trainer first waits
        self.orch = factory(self.ocfg, list(self.rollout_ids))
        self.mapping = EventMapping(self.orch, self)  # the runtime's: events -> orchestrator calls
        self.elastic_in_pool = False
        # sample / group bookkeeping
        self.groups: dict[str, _GroupState] = {}
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
        self.trainer = _Trainer()
        #: sample id -> the versions that produced its tokens, once it crossed one (partial mode)
        self.spans: dict[str, set[int]] = {}
        #: what happened, in order, for after the action list being applied: events for the
        #: orchestrator, or the simulator's own deferred steps (callables)
        self._notes: deque[Event | Callable[[], None]] = deque()
        self._last_progress = 0.0
        self._last_stats = 0.0
        self.window_start: float | None = 0.0 if cfg.sim.warmup_steps == 0 else None
        # accounting: every metric comes from the recorder's events (observability/recorder.py)
        self.step_rows: list[dict[str, Any]] = []
        self.metrics = MetricsRecorder(slots_per_instance=self.slot_cap, rebalancer=self.orch.policy.rebalance,
                                       warmup_steps=cfg.sim.warmup_steps, sinks=[_RowSink(self.step_rows)])
        self._busy_seen = 0.0  # the instance models' busy slot-seconds already reported
        self.series: dict[str, list[Any]] = {k: [] for k in (
            "step", "end_s", "step_time_s", "wait_s", "train_s", "weight_sync_s", "tokens", "bubble",
            "mean_staleness", "live_versions", "instances_by_version", "mean_response_tokens",
            "max_response_tokens")}
        self.sim_c3 = 0
        self.sim_lost = 0
        self.migrations = 0
        self.migrated_bytes = 0.0
        self.migration_s = 0.0
        self.reprefill_tokens = 0
        self.switch_s_total = 0.0  # instance-seconds spent loading weights (window)
        self.dual_switches = 0  # SwitchVersion actions that kept the old version's tail
        self.orch_calls = 0
        self.orch_wall_s = 0.0
        self.orch_rebalance_wall_s = 0.0
        self.orch_max_call_s = 0.0
        # cost.rebalance_overhead_s owed by the actions being applied (set while applying the
        # actions of an orchestrator call that ran a rebalance)
        self._rebalance_overhead_s = 0.0
        self.deadlock = False
        self._last_step_end = 0.0

    # ================================================================== orchestrator calls
    def _feed(self, event: Event) -> None:
        """``event`` through the runtime's mapping, timed (the orchestrator's share of the run), then
        its actions applied."""
        before = self.orch.counters.rebalances
        t = _time.perf_counter()
        actions = self.mapping.feed(event)
        dt = _time.perf_counter() - t
        self.orch_calls += 1
        self.orch_wall_s += dt
        self.orch_max_call_s = max(self.orch_max_call_s, dt)
        rebalances = self.orch.counters.rebalances - before
        if rebalances:
            self.orch_rebalance_wall_s += dt
        # a rebalance's fixed control-plane cost (cost.rebalance_overhead_s): the switches and KV
        # transfers it ordered start only after it
        self._rebalance_overhead_s = rebalances * self.cost.rebalance_overhead_s
        try:
            self.mapping.act(actions)
        finally:
            self._rebalance_overhead_s = 0.0

    def _note(self, item: Event | Callable[[], None]) -> None:
        self._notes.append(item)

    # ================================================================== the mapping's bookkeeping hooks
    # (controller/loop.py::Executor): the simulator has no stale reports (it drops a stale switch or
    # wake itself, and reports only instances in the pool), no journal and no checkpoints

    def now(self) -> float:
        return self.q.now

    def prompt_tokens(self, group_id: str) -> int:
        return self.groups[group_id].spec.prompt_tokens

    def absorb(self, ev: EngineReply) -> int:
        return int(ev.resp)  # the simulated answer is its length

    def turn_current(self, sample_id: str, turn: Any) -> bool:
        """The turn event is about the trajectory's present turn (``turn``: its index)."""
        entry = self.tooling.get(sample_id)
        return entry is not None and entry[0].turn == turn

    def sample_versions(self, sample_id: str) -> Iterable[int]:
        return self.spans.get(sample_id) or (self.reqs[sample_id].version,)

    def replayed(self, sample_id: str) -> int:
        raise SimProtocolError(f"replay of {sample_id}: the simulator keeps no journal")

    def is_current(self, instance: str, engine: Any) -> bool:
        return True

    def switch_landed(self, ev: SwitchDone, origin: Any) -> bool:
        return True

    def mark_failed(self, ev: InstanceFailed, origin: Any) -> bool:
        return True

    def register(self, ev: InstanceJoined) -> bool:
        return True

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        return int(ev.result["version"]), False  # the step's metrics were recorded as it ended

    def write_controller_state(self, version: int, orchestrator_snapshot: dict) -> None:
        raise SimProtocolError(f"checkpoint v{version}: the simulator writes none")

    def step_boundary(self) -> bool:
        """The run's last step ended (the mapping then does not tell the orchestrator)."""
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
        self.groups[a.group_id] = _GroupState(spec, a.version, tuple(a.sample_ids), dispatch_s=now)
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
                self.reprefill_tokens += prefill
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
            self.reprefill_tokens += prefill
        self._sync(inst)
        self._place(req, inst, prefill)
        self._touch(inst)

    def _start_transfer(self, req: SimRequest, dst: SimInstance, counted_as_migration: bool = True) -> None:
        dt = kv_transfer_s(self.cost, req.context) + (self._rebalance_overhead_s if counted_as_migration else 0.0)
        self.transit[req.sample_id] = (req, dst.iid)
        if self._in_window():
            self.migrations += 1 if counted_as_migration else 0
            self.migrated_bytes += req.context * self.cost.kv_bytes_per_token
            self.migration_s += dt
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
                self.reprefill_tokens += prefill
                self._note(MigrationDone(a.sample_id, prefill))
            if self._in_window():
                self.migrations += 1
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
        elif a.instance in self.elastic_ids:
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
        if self.trainer.busy:
            raise SimProtocolError(f"batch {a.step} released while the trainer is busy")
        if a.step >= self.cfg.sim.steps:
            raise SimProtocolError(f"batch {a.step} released after the last step ({self.cfg.sim.steps} steps): "
                                   "its groups would be consumed and never trained")
        if len(a.group_ids) != self.ocfg.tbs:
            raise SimProtocolError(f"batch {a.step} has {len(a.group_ids)} groups, TBS={self.ocfg.tbs}")
        tokens = 0
        stal: list[int] = []
        lengths: list[int] = []
        for gid in a.group_ids:
            g = self.groups.get(gid)
            if g is None:
                raise SimProtocolError(f"release of unknown group {gid}")
            g.consumed += 1
            if g.consumed > 1:
                continue  # counted by the orchestrator (duplicated_groups)
            if g.finished < len(g.sample_ids):
                self.sim_lost += 1  # its unfinished samples would be dropped
            lag = a.step - g.version
            if lag > self.S or lag < 0:
                self.sim_c3 += 1
            stal.append(lag)
            tokens += g.spec.total_tokens
            lengths.extend(g.spec.response_tokens)
        self.trainer.busy = True
        wait = now - self.trainer.idle_since
        train = self.cost.train_s(tokens, self.cfg.cluster.trainer_gpu_count(self.mode))
        if self.colocated:
            for inst in self.instances.values():
                self._sync(inst)
                inst.pause(now)
                inst.epoch += 1
                inst.mark(now, self.record_timeline)
            sync_s = 2 * self.cost.colocated_switch_s
        else:
            sync_s = self.cost.trainer_push_s
            if self.elastic_in_pool:
                sync_s += self.cost.colocated_switch_s
                self._elastic_leave()
        mean_len = sum(lengths) / len(lengths) if lengths else 0.0
        max_len = max(lengths) if lengths else 0
        self.trainer.current = {
            "step": a.step, "wait_s": wait, "train_s": train, "sync_s": sync_s, "tokens": tokens,
            "staleness": stal, "bubble": (max_len - mean_len) / max_len if max_len else 0.0,
            "mean_len": mean_len, "max_len": max_len, "lengths": lengths,
        }
        self.q.push(now + train + sync_s, TRAIN_DONE, a.step)

    # ================================================================== elastic colocation
    def _elastic_join(self) -> None:
        self.elastic_in_pool = True
        for iid in self.elastic_ids:
            inst = self.instances[iid]
            inst.state = READY
            inst.version = None
            inst.mark(self.q.now, self.record_timeline)
            self.metrics.instance_joined(iid, self.q.now)
            self._note(InstanceJoined(iid, engine=None))

    def _elastic_leave(self) -> None:
        self.elastic_in_pool = False
        for iid in self.elastic_ids:
            inst = self.instances[iid]
            self._sync(inst)
            inst.state = PAUSED
            inst.epoch += 1
            inst.mark(self.q.now, self.record_timeline)
            self.metrics.instance_left(iid, self.q.now)
            # drained when the note runs: Submits later in the current action list land here too
            self._note(lambda iid=iid: self._elastic_fail(iid))

    def _elastic_fail(self, iid: str) -> None:
        inst = self.instances[iid]
        moved = []
        for sid, (req, dst) in list(self.transit.items()):
            if dst == iid:
                del self.transit[sid]
                moved.append(req)
        moved.extend(inst.drain_all(self.q.now))
        for sid, (req, last, _) in list(self.tooling.items()):
            if last == iid:
                self.tooling[sid] = (req, last, False)  # its prefix cache left with the instance
        for req in moved:
            self.where.pop(req.sample_id, None)
            self.held[req.sample_id] = (req, True)
        self._report_progress(moved)
        self._feed(InstanceFailed(iid, "elastic instance left: the trainer needs its accelerators"))

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
        self._last_progress = self.q.now
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
        cur = self.trainer.current
        # the trainer pushes (or swaps roles) after computing: the step's last sync_s seconds
        self.metrics.trainer_sync(now - cur["sync_s"], now)
        busy = sum(inst.occupied_slot_s(now) for inst in self.instances.values())
        self.metrics.busy_slot_seconds(busy - self._busy_seen)
        self._busy_seen = busy
        self.metrics.step_trained(step, end_s=now, wait_s=cur["wait_s"], train_s=cur["train_s"], tokens=cur["tokens"],
                                  staleness=cur["staleness"], rewards=(), response_lengths=cur["lengths"],
                                  live_versions=len(self.orch.live_versions()), migrations=self.migrations,
                                  migrated_kv_bytes=self.migrated_bytes, reprefill_tokens=self.reprefill_tokens)
        s = self.series
        s["step"].append(step)
        s["end_s"].append(now)
        s["step_time_s"].append(now - self._last_step_end)
        s["wait_s"].append(cur["wait_s"])
        s["train_s"].append(cur["train_s"])
        s["weight_sync_s"].append(cur["sync_s"])
        s["tokens"].append(cur["tokens"])
        s["bubble"].append(cur["bubble"])
        st = cur["staleness"]
        s["mean_staleness"].append(sum(st) / len(st) if st else None)
        s["live_versions"].append(len(self.orch.live_versions()))
        s["instances_by_version"].append({str(k): v for k, v in sorted(self.orch.instances_by_version().items())})
        s["mean_response_tokens"].append(cur["mean_len"])
        s["max_response_tokens"].append(cur["max_len"])
        self._last_step_end = now
        self.trainer.busy = False
        self.trainer.idle_since = now
        self.trainer.steps_done += 1
        self._last_progress = now
        if self.trainer.steps_done == self.cfg.sim.warmup_steps and self.window_start is None:
            self._open_window(now)
        if self.colocated:
            for inst in self.instances.values():
                if inst.state == PAUSED:
                    inst.resume(now)
                    inst.epoch += 1
                    self._touch(inst)
        if self.mode == "partial" and not self.step_boundary():
            self._report_progress(self._running_requests())
        # the run's last step ends the run in the mapping (step_boundary): the orchestrator does
        # not hear of it, so it cannot release a batch nobody will train
        self._note(TrainerDone(step, {"version": step + 1}, start=now - cur["train_s"] - cur["sync_s"],
                               train_s=cur["train_s"], batch=None))
        self._note(self._maybe_elastic_join)

    def _maybe_elastic_join(self) -> None:
        if self.elastic_ids and not self.trainer.busy and not self.elastic_in_pool and self.trainer.steps_done < self.cfg.sim.steps:
            self._elastic_join()

    def _on_poll(self) -> None:
        now = self.q.now
        wm = self.ocfg.kv_high_watermark
        stats_due = now - self._last_stats >= self.cfg.sim.stats_interval_s - 1e-9
        if stats_due:
            self._last_stats = now
            for iid in list(self.instances):
                inst = self.instances[iid]
                if inst.state != READY or not inst.running:
                    continue
                # an engine with requests waiting for KV is full, whatever its nominal usage
                kv = 1.0 if inst.queue else inst.kv_usage()
                if kv >= wm:
                    # periodic engine report while over the watermark (what the runtime polls)
                    self._report_progress(inst.running.values())
                    self._note(InstanceStats(iid, inst.load, kv, engine=None))
        self._note(Tick())
        self.q.push(now + self.cfg.sim.poll_interval_s, POLL)

    # ================================================================== helpers
    def _running_requests(self) -> list[SimRequest]:
        out = []
        for inst in self.instances.values():
            self._sync(inst)
            out.extend(inst.running.values())
            out.extend(r for r, _ in inst.queue)
        out.extend(r for r, _ in self.transit.values())
        return out

    def _report_progress(self, reqs: Any) -> None:
        """Tokens generated so far, as an engine's abort answer reports them. Not for a multi-turn
        trajectory: an interrupted one is run again from its prompt (as a runtime's workflow answer
        to an abort carries no tokens), so the orchestrator never resumes it on other weights."""
        for req in list(reqs):
            if req.turn_ends:
                continue
            inst = self.instances.get(self.where.get(req.sample_id, ""))
            gen = req.generated
            if inst is not None and req.sample_id in inst.running:
                gen = req.generated + (inst.steps_done - req.admit_step)
            if gen > 0:
                self.mapping.step(SampleProgress(req.sample_id, gen))

    def _in_window(self) -> bool:
        return self.window_start is not None

    def _open_window(self, now: float) -> None:
        self.window_start = now
        self._busy_seen = 0.0  # the instance models count from the window's start on
        self.switch_s_total = 0.0
        self.migration_s = 0.0
        for inst in self.instances.values():
            inst.busy_slot_s = 0.0
            inst.window_start = now

    def _dispatch_event(self, kind: str, payload: Any) -> None:
        if kind == WAKE:
            self._on_wake(payload)
        elif kind == SWITCH_DONE:
            self._on_switch_done(payload)
        elif kind == ARRIVE:
            self._on_arrive(payload)
        elif kind == TRAIN_DONE:
            self._on_train_done(payload)
        elif kind == POLL:
            self._on_poll()
        elif kind == TOOL_DONE:
            self._on_tool_done(payload)

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
        self.q.push(cfg.sim.poll_interval_s, POLL)
        stall_limit = max(60.0, 50 * cfg.sim.poll_interval_s)
        while self.trainer.steps_done < cfg.sim.steps and len(self.q):
            t, kind, payload = self.q.pop()
            if t > cfg.sim.max_sim_time_s:
                break
            if kind != POLL:
                self._last_progress = t
            self._dispatch_event(kind, payload)
            self._drain()
            if kind == POLL and t - self._last_progress > stall_limit and not self.trainer.busy:
                busy = any(i.running or i.queue for i in self.instances.values()) or self.transit or self.tooling
                if not busy:
                    self.deadlock = True
                    log.error("simulation stalled at t=%.1fs: no work in flight and the trainer idle", t)
                    break
        end = self.q.now
        for inst in self.instances.values():
            inst.close_timeline(end)
        return self._result(end, _time.perf_counter() - wall0)

    def _result(self, end: float, cpu_s: float) -> SimResult:
        cfg = self.cfg
        oc = self.orch.counters
        rows = self.metrics.rows
        wall = rows[-1].end_s if rows else end
        window_start = self.window_start if self.window_start is not None else 0.0
        n_roll = len(self.rollout_ids)
        span = max(1e-9, wall - window_start)
        totals = RunTotals(
            dispatched_groups=oc.dispatched_groups,
            consumed_groups=oc.consumed_groups,
            lost_groups=self.sim_lost + self.orch.audit(),
            duplicated_groups=oc.duplicated_groups,
            c1_violations=oc.c1_violations,
            c3_violations=max(oc.c3_violations, self.sim_c3),
            migrations=self.migrations,
            migrated_kv_bytes=self.migrated_bytes,
            reprefill_tokens=self.reprefill_tokens,
        )
        summary = self.metrics.summary(mode=self.mode, max_staleness=self.S, tbs=self.ocfg.tbs,
                                       rbs=self.orch.policy.rbs, totals=totals, wall_time_s=wall)
        n_steps = max(1, len(rows))
        timeline = []
        if self.record_timeline:
            for iid, inst in list(self.instances.items())[: cfg.sim.timeline_max_instances]:
                timeline.extend((iid, a, b, v, st) for a, b, v, st in inst.intervals)
        extra = {
            "placement": self.placement,
            "rollout_instances": n_roll,
            "elastic_instances": len(self.elastic_ids),
            "trainer_gpus": cfg.cluster.trainer_gpu_count(self.mode),
            "total_gpus": cfg.cluster.total_gpus,
            "deadlock": self.deadlock,
            "virtual_time_s": end,
            "sim_cpu_s": cpu_s,
            "orchestrator_calls": self.orch_calls,
            "orchestrator_wall_s": self.orch_wall_s,
            "orchestrator_wall_s_per_step": self.orch_wall_s / n_steps,
            "orchestrator_rebalances": oc.rebalances,
            "orchestrator_wall_s_per_rebalance": (self.orch_rebalance_wall_s / oc.rebalances) if oc.rebalances else None,
            "orchestrator_max_call_s": self.orch_max_call_s,
            "orchestrator_summary": self.orch.summary(),
            # what a checkpoint holds of the orchestrator: must stay O(outstanding work), not O(steps)
            "orchestrator_state_bytes": len(json.dumps(self.orch.snapshot()).encode()),
            "switch_instance_s": self.switch_s_total,
            # orchestrator.dual_version: switches that kept the old version's tail, and the
            # instance-seconds a second weight set was held (its memory, counted)
            "dual_switches": self.dual_switches,
            "dual_weight_instance_s": sum(i.dual_s + ((end - i.tail_since) if i.tail_version is not None else 0.0)
                                          for i in self.instances.values()),
            "migration_fraction": self.migration_s / (max(1, n_roll) * self.slot_cap * span),
            "slot_cap": self.slot_cap,
            "sim_checks": {"c3": self.sim_c3, "lost": self.sim_lost},
            "mean_response_tokens": (sum(self.series["mean_response_tokens"]) / n_steps) if rows else None,
            "speculation": _speculation_report_of(self.decode_model, cfg, self.instances.values()),
        }
        return SimResult(summary=summary, series=self.series, timeline=timeline, extra=extra, steps=self.step_rows)


def _speculation_report_of(model: DecodeModel, cfg: SimConfig, instances) -> dict[str, Any]:
    """What speculation did in a run: the model's tokens per verify step and the share of decoded
    tokens that came from verify steps (the rest were decoded at batches where the policy does not draft)."""
    decoded = sum(i.decoded_tokens for i in instances)
    spec = sum(i.spec_tokens for i in instances)
    out: dict[str, Any] = {"mode": cfg.rollout.speculative, "spec_tokens": cfg.rollout.spec_tokens,
                           "spec_max_batch": cfg.rollout.spec_max_batch,
                           "decoded_tokens": decoded, "speculative_tokens": spec,
                           "speculative_token_share": spec / decoded if decoded else 0.0}
    if model.spec is not None:
        out["acceptance"] = model.acceptance
        out["draft_tokens"] = model.draft_tokens  # the engine policy's draft length for a lone request
        out["tokens_per_verify_step"] = model.tokens_per_verify
        out["verify_steps_per_request_token"] = 1.0 / model.tokens_per_verify
        out["largest_speculating_batch"] = model.largest_speculating_batch
    return out


class _RowSink:
    """Keeps each step's scalars (the simulator's steps.jsonl rows)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        self.rows.append({"step": step, **values})


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation of ``cfg`` (its ``orchestrator.mode``)."""
    return Simulation(cfg).run()
