"""The rollout pool: which instances are in the job, which joined late, failed or came back.

WHY a component of its own: membership has rules of its own. A failure seen through a client that
has since been replaced (the instance was restarted and rejoined) is stale; an instance that was
only slow to load when the job started is not counted as failed; losing every instance ends the
run unless a supervisor may bring them back. Whether an instance is failed now is the
orchestrator's (it owns run state); this component asks it and keeps only what the orchestrator
does not know: the clients, who ever failed or rejoined, who was absent at the start. The executor
(:class:`~dora_megatron.controller.runtime.Runtime`) hands it the
:class:`~dora_megatron.events.InstanceJoined` and :class:`InstanceFailed` events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Set as AbstractSet
from typing import TYPE_CHECKING, Any

from dora_megatron.events import InstanceFailed, InstanceJoined
from dora_megatron.controller.records import Engine
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.orchestrator import Orchestrator

if TYPE_CHECKING:
    from dora_megatron.controller.samples import SampleStore

log = logging.getLogger(__name__)


class Pool:
    """Instance membership and failures (DESIGN section 5.6). ``orch``: whether an instance is
    failed is its; ``engines``: the clients (a joining instance's is put there); ``store``: the
    outstanding samples (a failed instance's are no longer waited on); ``tasks``: the clock, and the
    end of the run when every instance failed."""

    def __init__(self, *, orch: Orchestrator, engines: dict[str, Engine], metrics: MetricsRecorder,
                 store: SampleStore, tasks: RunTasks) -> None:
        self.orch = orch
        self.engines = engines
        self.metrics = metrics
        self.store = store
        self.tasks = tasks
        self.failed_ever: set[str] = set()  # every instance that failed at least once (rejoined ones too)
        self.rejoins = 0  # failed instances that came back (``add_instance`` of a failed name)
        self.samples_after_rejoin = 0  # samples finished on an instance after it rejoined
        self._rejoined: set[str] = set()
        #: engine processes restarted by a supervising launcher (None: no supervisor, e.g. SLURM)
        self.engine_restarts: int | None = None
        #: set by a supervisor that restarts failed instances: losing all of them is not fatal then
        #: (the supervisor ends the run when no restart is left)
        self.instances_may_return = False
        #: instances not ready when the job started (name -> why): out of the pool until they join
        self.absent_at_start: dict[str, str] = {}
        self._late_starters: set[str] = set()  # of those, the ones that never failed (only slow to load)

    def is_failed(self, instance: str) -> bool:
        """Whether ``instance`` is failed (one the orchestrator does not know is): the orchestrator's
        view (it owns run state), not a copy. O(1): what a launcher's poller asks per instance."""
        return not self.orch.is_alive(instance)

    def all_failed(self) -> bool:
        """Whether the pool has instances and none is alive. O(1) while the orchestrator counts none
        alive, else it stops at the first alive instance: pollers ask it every poll, at 4,096 instances."""
        orch, engines = self.orch, self.engines
        if not engines:
            return False
        return orch.alive_count() == 0 or not any(orch.is_alive(iid) for iid in engines)

    def instance_version(self, instance: str) -> int | None:
        """The weights ``instance`` serves, as the orchestrator knows them (None: unknown to it, or
        joined and not switched yet); the executor keeps no copy."""
        inst = self.orch.instances.get(instance)
        return None if inst is None else inst.version

    @property
    def failed(self) -> set[str]:
        """The pool's failed instances, O(pool): for tests, which compare the whole set; pollers ask
        :meth:`is_failed` / :meth:`all_failed` instead."""
        return {iid for iid in self.engines if self.is_failed(iid)}

    def is_current(self, instance: str, engine: object) -> bool:
        """Loop: ``engine`` is still ``instance``'s client and the instance has not failed."""
        return not self.is_failed(instance) and self.engines.get(instance) is engine

    def start_without(self, absent: Mapping[str, str], loading: AbstractSet[str] = frozenset()) -> None:
        """Call before the run begins: it starts without ``absent`` (name -> why they are not ready;
        the launcher adds each once it serves, ``Runtime.add_instance``). ``loading``: those of them
        that did not fail, only were not ready yet (they are not counted as failed instances)."""
        self.absent_at_start = dict(absent)
        self._late_starters = set(loading) & set(absent)

    def register(self, ev: InstanceJoined) -> bool:
        """Loop (:class:`InstanceJoined`): put the client in the pool; whether the orchestrator is to hear of it."""
        name, engines = ev.instance, self.engines
        if name in engines and not self.is_failed(name):
            log.warning("instance %s is already in the pool; ignoring its second join", name)
            return False
        engines[name] = ev.engine
        self._late_starters.discard(name)
        self.metrics.instance_joined(name, self.tasks.now())
        if name in self.failed_ever and self.is_failed(name):  # (a new name is unknown to the orchestrator too)
            self.rejoins += 1
            self._rejoined.add(name)
            log.info("instance %s rejoined the pool", name)
        else:
            log.info("instance %s joined the pool", name)
        return True

    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task[Any] | None) -> bool:
        """Loop (:class:`InstanceFailed`): whether the orchestrator is to hear of it. ``ev.engine``:
        the client the failing call used; a failure seen through a client that has since been
        replaced (the instance was restarted and rejoined) is stale and ignored. The requests in
        flight there are cancelled (not the one that reported, ``origin``)."""
        instance, why, engines = ev.instance, ev.why, self.engines
        if self.is_failed(instance) or instance not in engines:
            return False
        if ev.engine is not None and engines.get(instance) is not ev.engine:
            log.info("ignoring a stale failure of %s (replaced since): %s", instance, why)
            return False
        log.warning("instance %s failed: %s", instance, why)
        self.metrics.instance_left(instance, self.tasks.now())
        if instance not in self._late_starters:
            self.failed_ever.add(instance)  # (the orchestrator hears of it next: it owns which instances are failed)
        for rec in self.store.samples.values():  # stop waiting on requests that lived there
            if rec.gen_instance == instance and rec.gen_task is not None and rec.gen_task is not origin \
                    and not rec.gen_task.done() and not rec.finished:
                rec.gen_task.cancel()
        if all(i == instance or self.is_failed(i) for i in engines) and not self.instances_may_return:
            self.tasks.stop(RuntimeError("every rollout instance failed"))
        return True

    def sample_finished(self, instance: str) -> None:
        """A sample finished on ``instance`` (counted when it had rejoined: ``samples_after_rejoin``)."""
        if instance in self._rejoined:
            self.samples_after_rejoin += 1
