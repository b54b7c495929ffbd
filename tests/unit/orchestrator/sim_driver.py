"""A tiny discrete-event driver for the orchestrator, with its own independent ledger.

It plays the engines (heavy-tailed response lengths, so finish orders are random), the trainer,
failures and joins, executes every action the orchestrator emits, and checks the contract from
the outside: engines refuse a request whose version differs from their weights (C1), switching
instances hold and take no requests, every batch has exactly TBS complete, never-seen-before
groups within the staleness bound (C2, C3).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import (Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion, perform)


class ContractViolation(AssertionError):
    pass


@dataclass
class EngineSample:
    length: float
    done: float = 0.0          # tokens generated so far
    started_at: float = 0.0    # when the current run started
    instance: str | None = None
    versions: set[int] = field(default_factory=set)  # versions that generated its tokens
    finished: bool = False
    epoch: int = 0             # invalidates scheduled finish events after a move/interrupt


@dataclass
class Engine:
    version: int | None
    alive: bool = True
    switching_to: int | None = None
    running: set[str] = field(default_factory=set)
    tail_version: int | None = None  # second weight set kept for the requests of ``tail`` (dual version)
    tail: set[str] = field(default_factory=set)


class Driver:
    """Plays engines and trainer; an :class:`~dora_megatron.orchestrator.ActionHandler`."""

    def __init__(self, cfg: OrchestratorConfig, n_instances: int, seed: int, fail_prob: float = 0.0,
                 join_prob: float = 0.0, switch_time: float = 0.5, train_time: float = 3.0,
                 tick_every: float = 2.0, tail_alpha: float = 1.3, max_len: float = 200.0,
                 migration_fail_prob: float = 0.0) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.S = cfg.effective_staleness
        self.fail_prob, self.join_prob = fail_prob, join_prob
        self.migration_fail_prob = migration_fail_prob
        self.switch_time, self.train_time, self.tick_every = switch_time, train_time, tick_every
        self.tail_alpha, self.max_len = tail_alpha, max_len
        ids = [f"i{k}" for k in range(n_instances)]
        self.engines = {i: Engine(version=0) for i in ids}
        self.orch = Orchestrator(cfg, ids)
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.samples: dict[str, EngineSample] = {}
        self.group_version: dict[str, int] = {}
        self.group_samples: dict[str, tuple[str, ...]] = {}
        self.consumed: dict[str, int] = {}
        self.steps_done = 0
        self.trainer_busy = False
        self.next_join = itertools.count()
        self.max_running_versions = 0
        self.batches: list[ReleaseBatch] = []

    # -------------------------------------------------------------- scheduling
    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    def _length(self) -> float:
        return min(self.max_len, self.rng.paretovariate(self.tail_alpha) * 3.0)

    # -------------------------------------------------------------- actions
    def execute(self, actions) -> None:
        perform(self, actions)

    def dispatch(self, a: Dispatch) -> None:
        if a.group_id in self.group_version:
            raise ContractViolation(f"group {a.group_id} dispatched twice")
        if len(a.sample_ids) != self.cfg.group_size:
            raise ContractViolation("group size")
        self.group_version[a.group_id] = a.version
        self.group_samples[a.group_id] = a.sample_ids
        for sid in a.sample_ids:
            self.samples[sid] = EngineSample(self._length())
        self.orch.set_prompt_tokens(a.group_id, 10)

    def submit(self, a: Submit) -> None:
        self._start(a.sample_id, a.instance, a.version)

    def migrate(self, a: Migrate) -> None:
        s = self.samples[a.sample_id]
        if s.instance != a.src or a.sample_id not in self.engines[a.src].running:
            raise ContractViolation(f"migrate {a.sample_id} not on {a.src}")
        self._stop(a.sample_id)
        if self.rng.random() < self.migration_fail_prob:
            # the transfer failed: the request was aborted at src, partial output kept
            self.execute(self.orch.on_migration_failed(a.sample_id))
        else:
            self._start(a.sample_id, a.dst, a.version)

    def interrupt(self, a: Interrupt) -> None:
        s = self.samples[a.sample_id]
        if s.instance != a.instance:
            raise ContractViolation(f"interrupt {a.sample_id} not on {a.instance}")
        self._stop(a.sample_id)
        self.execute(self.orch.on_sample_progress(a.sample_id, int(s.done)))

    def switch_version(self, a: SwitchVersion) -> None:
        e = self.engines[a.instance]
        if a.keep is not None:
            if not self.cfg.dual_version:
                raise ContractViolation("dual-version switch with orchestrator.dual_version off")
            if e.tail_version is not None or e.switching_to is not None or e.version != a.keep:
                raise ContractViolation(f"dual switch of {a.instance} keeping v{a.keep}: it holds v{e.version}, "
                                        f"tail v{e.tail_version}, switching to {e.switching_to}")
            e.tail_version, e.tail = a.keep, set(e.running)
        elif e.running:
            raise ContractViolation(f"switch of {a.instance} with running requests {sorted(e.running)}")
        if not e.alive:
            raise ContractViolation(f"switch of dead {a.instance}")
        if a.version > self.orch.newest:
            raise ContractViolation("switch to weights that do not exist")
        e.switching_to = a.version
        self._at(self.now + self.switch_time * self.rng.random(), "switch_done", a.instance, a.version)

    def release_batch(self, a: ReleaseBatch) -> None:
        self._release(a)

    def _start(self, sid: str, iid: str, version: int) -> None:
        e = self.engines[iid]
        s = self.samples[sid]
        if not e.alive:
            raise ContractViolation(f"submit to dead {iid}")
        if e.switching_to is not None:
            raise ContractViolation(f"submit to switching {iid}")
        if e.version != version:
            raise ContractViolation(f"engine {iid} on v{e.version} refuses request tagged v{version}")
        if s.finished or s.instance is not None:
            raise ContractViolation(f"{sid} started twice")
        s.instance = iid
        s.started_at = self.now
        s.epoch += 1
        e.running.add(sid)
        self._at(self.now + (s.length - s.done), "finish", sid, s.epoch)

    def _stop(self, sid: str) -> None:
        s = self.samples[sid]
        gen = self.now - s.started_at
        e = self.engines[s.instance]
        if gen > 0:
            s.done += gen
            s.versions.add(e.tail_version if sid in e.tail else e.version)
        e.running.discard(sid)
        if sid in e.tail:
            e.tail.discard(sid)
            if not e.tail:
                e.tail_version = None  # the tail drained: its weights are dropped
        s.instance = None
        s.epoch += 1

    def _release(self, a: ReleaseBatch) -> None:
        if self.trainer_busy:
            raise ContractViolation("batch released while the trainer is busy")
        if a.step != self.steps_done:
            raise ContractViolation(f"batch for step {a.step}, expected {self.steps_done}")
        if len(a.group_ids) != self.cfg.tbs:
            raise ContractViolation(f"batch of {len(a.group_ids)} groups, TBS={self.cfg.tbs}")
        for gid in a.group_ids:
            if gid in self.consumed:
                raise ContractViolation(f"group {gid} consumed twice (C2)")
            if gid not in self.group_version:
                raise ContractViolation(f"group {gid} never dispatched")
            if not all(self.samples[sid].finished for sid in self.group_samples[gid]):
                raise ContractViolation(f"group {gid} released before complete")
            lag = a.step - self.group_version[gid]
            if lag > self.S or lag < 0:
                raise ContractViolation(f"group {gid} v{self.group_version[gid]} in step {a.step} (C3)")
            self.consumed[gid] = a.step
        vs = [self.group_version[g] for g in a.group_ids]
        if vs != sorted(vs):
            raise ContractViolation("batch not oldest version first")
        self.batches.append(a)
        self.trainer_busy = True
        self._at(self.now + self.train_time * (0.5 + self.rng.random()), "step_done", a.step + 1)

    # -------------------------------------------------------------- loop
    def _check(self) -> None:
        vs = {e.tail_version if s in e.tail else e.version for e in self.engines.values() for s in e.running}
        self.max_running_versions = max(self.max_running_versions, len(vs))
        if len(self.orch.live_versions()) > self.S + 1:
            raise ContractViolation(f"live versions {self.orch.live_versions()} > S+1")
        alive = sum(1 for e in self.engines.values() if e.alive)
        if sum(self.orch.instances_by_version().values()) != alive:
            raise ContractViolation("partition does not sum to the pool")

    def run(self, steps: int, max_events: int = 200_000) -> None:
        self.execute(self.orch.start())
        self._at(self.tick_every, "tick")
        n = 0
        while self.steps_done < steps:
            n += 1
            if n > max_events:
                raise ContractViolation("too many events")
            if not self.events or all(k == "tick" for _, _, k, _ in self.events):
                # nothing can happen any more: the orchestrator must still act (no deadlock)
                acts = self.orch.on_tick(self.now + 1000.0)
                if not acts:
                    raise ContractViolation(f"deadlock at step {self.steps_done}: {self.orch.summary()}")
                self.execute(acts)
                continue
            t, _, kind, args = heapq.heappop(self.events)
            self.now = max(self.now, t)
            if kind == "finish":
                sid, epoch = args
                s = self.samples[sid]
                if s.epoch != epoch or s.instance is None:
                    continue
                iid = s.instance
                self._stop(sid)
                s.finished = True
                self.execute(self.orch.on_sample_finished(sid, int(s.done), now=self.now))
                if self.rng.random() < 0.3:
                    e = self.engines[iid]
                    if e.alive and e.switching_to is None:
                        kv = min(1.0, len(e.running) / 8.0)
                        self.execute(self.orch.on_instance_stats(iid, len(e.running), kv))
            elif kind == "switch_done":
                iid, v = args
                e = self.engines[iid]
                if not e.alive or e.switching_to != v:
                    continue
                e.version, e.switching_to = v, None
                self.execute(self.orch.on_switch_done(iid, v))
            elif kind == "step_done":
                (version,) = args
                self.trainer_busy = False
                self.steps_done = version
                self.execute(self.orch.on_step_finished(version))
            elif kind == "tick":
                self.execute(self.orch.on_tick(self.now))
                self._maybe_fail_or_join()
                self._at(self.now + self.tick_every, "tick")
            self._check()
        self.final_checks()

    def _maybe_fail_or_join(self) -> None:
        alive = [i for i, e in self.engines.items() if e.alive]
        if len(alive) > 1 and self.rng.random() < self.fail_prob:
            iid = self.rng.choice(sorted(alive))
            e = self.engines[iid]
            for sid in list(e.running):
                self._stop(sid)   # partial output kept by the driver (streamed)
            e.alive = False
            e.switching_to = None
            self.execute(self.orch.on_instance_failed(iid))
        if self.rng.random() < self.join_prob:
            iid = f"j{next(self.next_join)}"
            self.engines[iid] = Engine(version=None)
            self.execute(self.orch.on_instance_joined(iid))

    def final_checks(self) -> None:
        mode = self.cfg.mode
        for sid, s in self.samples.items():
            if mode != "partial" and len(s.versions) > 1:
                raise ContractViolation(f"C1: {sid} generated by versions {s.versions}")
        # C2: every group of a version that can no longer be trained was consumed exactly once
        horizon = self.orch.next_step - self.S
        for gid, v in self.group_version.items():
            if v < horizon and gid not in self.consumed:
                raise ContractViolation(f"C2: group {gid} of v{v} never consumed (next step {self.orch.next_step})")
        if self.orch.audit() != 0:
            raise ContractViolation("orchestrator lost groups")
        summ = self.orch.summary()
        if summ["consumed_groups"] != len(self.consumed) or summ["dispatched_groups"] != len(self.group_version):
            raise ContractViolation("counters disagree with the ledger")
        if mode != "partial" and summ["c1_violations"]:
            raise ContractViolation("orchestrator counted C1 violations")
        if summ["c3_violations"] or summ["duplicate_releases"]:
            raise ContractViolation("orchestrator counted C3 violations / duplicates")
