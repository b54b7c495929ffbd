"""What the runtime learns by asking its engines, played on the simulated instances: periodic
stats of instances over the KV watermark, the clock's tick, and the tokens generated so far of
requests about to be interrupted or moved.

WHY apart from the executor (:mod:`.engine`): these are reports *to* the orchestrator (the
runtime's stats poller and abort answers), not effects of its actions; they reach it as the
runtime's own events (``InstanceStats``, ``Tick``, ``SampleProgress``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from dora_megatron.events import Event, EventMapping, InstanceStats, SampleProgress, Tick
from dora_megatron.sim.clock import POLL
from dora_megatron.sim.events import EventQueue
from dora_megatron.sim.instance import READY, SimInstance, SimRequest


class _Run(Protocol):
    """What the polls read of the simulation."""

    q: EventQueue
    instances: dict[str, SimInstance]
    where: dict[str, str]
    transit: dict[str, tuple[SimRequest, str]]
    mapping: EventMapping

    def _note(self, item: Event | Callable[[], None]) -> None: ...

    def _sync(self, inst: SimInstance, wake: bool = False) -> None: ...


class EnginePolls:
    """The engines' reports (``watermark``: orchestrator.kv_high_watermark)."""

    def __init__(self, run: _Run, watermark: float, stats_interval_s: float, poll_interval_s: float) -> None:
        self.run = run
        self.watermark = watermark
        self.stats_interval_s = stats_interval_s
        self.poll_interval_s = poll_interval_s
        self.last_stats = 0.0

    def poll(self) -> None:
        """One poll: the stats of instances over the watermark (every ``stats_interval_s``), then
        the clock's tick; the next poll is scheduled."""
        run = self.run
        now = run.q.now
        if now - self.last_stats >= self.stats_interval_s - 1e-9:
            self.last_stats = now
            for iid in list(run.instances):
                inst = run.instances[iid]
                if inst.state != READY or not inst.running:
                    continue
                # an engine with requests waiting for KV is full, whatever its nominal usage
                kv = 1.0 if inst.queue else inst.kv_usage()
                if kv >= self.watermark:
                    # periodic engine report while over the watermark (what the runtime polls)
                    self.report_progress(inst.running.values())
                    run._note(InstanceStats(iid, inst.load, kv, engine=None))
        run._note(Tick())
        run.q.push(now + self.poll_interval_s, POLL)

    def in_flight(self) -> list[SimRequest]:
        """Every request on an instance (running or queued) or in transit, instances synced first."""
        run = self.run
        out = []
        for inst in run.instances.values():
            run._sync(inst)
            out.extend(inst.running.values())
            out.extend(r for r, _ in inst.queue)
        out.extend(r for r, _ in run.transit.values())
        return out

    def report_progress(self, reqs: Iterable[SimRequest]) -> None:
        """Tokens generated so far, as an engine's abort answer reports them. Not for a multi-turn
        trajectory: an interrupted one is run again from its prompt (as a runtime's workflow answer
        to an abort carries no tokens), so the orchestrator never resumes it on other weights."""
        run = self.run
        for req in list(reqs):
            if req.turn_ends:
                continue
            inst = run.instances.get(run.where.get(req.sample_id, ""))
            gen = req.generated
            if inst is not None and req.sample_id in inst.running:
                gen = req.generated + (inst.steps_done - req.admit_step)
            if gen > 0:
                run.mapping.step(SampleProgress(req.sample_id, gen))
