"""Elastic colocation (``cluster.elastic_colocation``): the trainer's accelerators serve as extra
rollout instances while the trainer waits for data.

WHY a policy of its own: it is the one place the simulated pool changes size. When training
starts the elastic instances leave (the orchestrator hears ``InstanceFailed``: their requests go
back to it and are resubmitted to same-version instances; the simulator keeps their KV with them
instead of re-prefilling), and they rejoin (``InstanceJoined``) when the trainer next waits.
"""

from __future__ import annotations

from typing import Callable, Protocol

from dora_megatron.events import Event, InstanceFailed, InstanceJoined
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.sim.events import EventQueue
from dora_megatron.sim.polls import EnginePolls
from dora_megatron.sim.instance import PAUSED, READY, SimInstance, SimRequest


class _Run(Protocol):
    """What the policy uses of the simulation."""

    q: EventQueue
    instances: dict[str, SimInstance]
    record_timeline: bool
    metrics: MetricsRecorder
    where: dict[str, str]
    held: dict[str, tuple[SimRequest, bool]]
    transit: dict[str, tuple[SimRequest, str]]
    tooling: dict[str, tuple[SimRequest, str, bool]]
    polls: EnginePolls

    def _note(self, item: Event | Callable[[], None]) -> None: ...

    def _feed(self, event: Event) -> None: ...

    def _sync(self, inst: SimInstance, wake: bool = False) -> None: ...



class ElasticColocation:
    """The elastic instances (``ids``; none without elastic colocation) and whether they are in the pool."""

    def __init__(self, run: _Run, ids: list[str]) -> None:
        self.run = run
        self.ids = ids
        self.in_pool = False

    def maybe_join(self, trainer_busy: bool, steps_left: bool) -> None:
        """The trainer waits (and steps remain): the elastic instances join the pool."""
        if self.ids and not trainer_busy and not self.in_pool and steps_left:
            self._join()

    def _join(self) -> None:
        run = self.run
        self.in_pool = True
        for iid in self.ids:
            inst = run.instances[iid]
            inst.state = READY
            inst.version = None
            inst.mark(run.q.now, run.record_timeline)
            run.metrics.instance_joined(iid, run.q.now)
            run._note(InstanceJoined(iid, engine=None))

    def leave(self) -> None:
        """Training starts: the elastic instances pause and leave the pool."""
        run = self.run
        self.in_pool = False
        for iid in self.ids:
            inst = run.instances[iid]
            run._sync(inst)
            inst.state = PAUSED
            inst.epoch += 1
            inst.mark(run.q.now, run.record_timeline)
            run.metrics.instance_left(iid, run.q.now)
            # drained when the note runs: Submits later in the current action list land here too
            run._note(lambda iid=iid: self._fail(iid))

    def _fail(self, iid: str) -> None:
        run = self.run
        inst = run.instances[iid]
        moved = []
        for sid, (req, dst) in list(run.transit.items()):
            if dst == iid:
                del run.transit[sid]
                moved.append(req)
        moved.extend(inst.drain_all(run.q.now))
        for sid, (req, last, _) in list(run.tooling.items()):
            if last == iid:
                run.tooling[sid] = (req, last, False)  # its prefix cache left with the instance
        for req in moved:
            run.where.pop(req.sample_id, None)
            run.held[req.sample_id] = (req, True)
        run.polls.report_progress(moved)
        run._feed(InstanceFailed(iid, "elastic instance left: the trainer needs its accelerators"))
