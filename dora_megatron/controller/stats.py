"""Stats polling: the one event source of instance load reports and of the loop's :class:`Tick`.

WHY a component of its own: polling is an event *source* (it only posts
:class:`~dora_megatron.events.InstanceStats`, :class:`InstanceFailed` and
:class:`Tick` on the queue, read by :class:`~dora_megatron.controller.loop.ControllerLoop`); it
decides nothing and holds no run state beyond the speculation counters (each instance's latest, and their
growth summed over the run). Which instance is
failed is the orchestrator's answer, asked per instance, never a copy kept here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from dora_megatron.controller.errors import is_local
from dora_megatron.events import InstanceFailed, InstanceStats, Tick
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.controller.records import Engine, LoadReport, LoadReports
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.rollout.speculation import counter_growth

log = logging.getLogger(__name__)

#: stats polls in flight at once during one sweep (not a config key; the client workers' own polls,
#: ``rollout.client_workers``, use the same bound: :mod:`~dora_megatron.controller.clients`)
STATS_CONCURRENCY = 64


class StatsPoller:
    """Polls (or takes pushed reports of) every live instance's load, ``stats_interval_s`` apart.

    ``engines``: the pool, shared with the executor (instances may join while it runs);
    ``observability``: ``stats_interval_s``; ``controller``: ``health_timeout_s`` (the config's
    sections themselves); ``on_local_shortage(what, err)``: counts a poll that failed for the
    controller's own shortage (the instance is not failed for it); ``concurrency``: polls in flight
    at once."""

    def __init__(self, orch: Orchestrator, engines: dict[str, Engine], events: EventQueue,
                 observability: ObservabilityConfig, controller: ControllerConfig,
                 on_local_shortage: Callable[[str, BaseException], None],
                 load_reports: LoadReports | None = None, on_sweep: Callable[[], None] | None = None,
                 concurrency: int = STATS_CONCURRENCY) -> None:
        self.orch = orch
        self.engines = engines
        self.events = events
        self.observability = observability
        self.controller = controller
        self.concurrency = concurrency
        self.on_local_shortage = on_local_shortage
        #: pushed load reports of the engines it covers, taken once per sweep instead of polling them
        self.load_reports = load_reports
        #: called after each sweep, its loads applied (the held draft pushes of instances now small enough)
        self.on_sweep = on_sweep
        self.spec_last: dict[str, dict[str, Any]] = {}  # each embedded instance's latest speculation counters
        self.spec_totals: dict[str, int] = {}  # their growth summed over the run (restarts included)

    def _is_failed(self, iid: str) -> bool:
        return not self.orch.is_alive(iid)

    async def _poll_stats(self, iid: str, engine: Engine, slots: asyncio.Semaphore) -> None:
        """One instance's load report, applied as soon as it arrives. ``health_timeout_s`` bounds
        the call itself, not the wait for a polling slot: a long sweep must not fail healthy instances.

        A timeout is confirmed by a second poll before the instance is failed: the answer of a
        healthy instance can sit unread while the controller's own loop lags (seconds at 1,024
        fake instances on a loaded machine, tools/controller_scale.py), and one late timer would
        then fail it. Errors (refused connection, HTTP error) fail it at once."""
        async with slots:
            for attempt in (1, 2):
                if self._is_failed(iid) or self.engines.get(iid) is not engine:
                    return
                try:
                    info = await asyncio.wait_for(engine.server_info(), timeout=self.controller.health_timeout_s)
                    break
                except asyncio.TimeoutError:
                    if attempt == 2:
                        self.events.post(InstanceFailed(
                            iid, f"server_info did not answer within {self.controller.health_timeout_s:g} s "
                                 "(controller.health_timeout_s), twice in a row", engine))
                        return
                    log.info("stats poll of %s timed out; asking again before failing it", iid)
                except Exception as err:  # noqa: BLE001 - unreachable engine = failed engine
                    if is_local(err):  # the controller's shortage: this sweep goes without its report
                        self.on_local_shortage(f"stats poll of {iid}", err)
                        return
                    self.events.post(InstanceFailed(iid, f"server_info failed: {err}", engine))
                    return
        self.apply_load(iid, engine, info)

    def apply_load(self, iid: str, engine: Engine, info: dict[str, Any]) -> None:
        """One instance's report (polled or pushed): its load goes on the queue, its speculation
        counters' growth is summed (a restarted instance counts from 0 again)."""
        if self._is_failed(iid) or self.engines.get(iid) is not engine:
            return  # failed or replaced while we asked
        if info.get("loads_unavailable"):
            return  # alive, but it reports no loads (no /v1/loads): the orchestrator's own count stands
        running = int(info.get("num_running_reqs", info.get("running", 0)) or 0)
        kv = float(info.get("kv_usage", info.get("token_usage", 0.0)) or 0.0)
        if "spec_verify_steps" in info:
            for k, n in counter_growth(self.spec_last.get(iid, {}), info).items():
                self.spec_totals[k] = self.spec_totals.get(k, 0) + n
            self.spec_last[iid] = info
        self.events.post(InstanceStats(iid, running, kv, engine))  # the loop drops it if failed/replaced meanwhile

    async def _apply_reports(self, reports: dict[Any, LoadReport], chunk: int = 128) -> None:
        """Pushed load reports, ``chunk`` per event-loop turn: thousands of instances in one turn
        would stall every request's completion behind them."""
        names = {id(e): iid for iid, e in self.engines.items()}
        for n, (engine, info) in enumerate(reports.items(), 1):
            iid = names.get(id(engine))
            if iid is None:
                continue
            if isinstance(info, tuple):  # ("failed", why): the one tuple a report is
                self.events.post(InstanceFailed(iid, str(info[1]), engine))
            else:
                self.apply_load(iid, engine, info)
            if n % chunk == 0:
                await asyncio.sleep(0)

    async def run(self, done: asyncio.Event) -> None:
        """Event source (the one place stats are polled): every ``stats_interval_s`` until ``done``,
        one sweep over every live instance, then a :class:`Tick`. WHY concurrent (at most
        ``concurrency`` calls in flight): asked one after the other, a sweep takes N round
        trips, so at a few hundred instances the load the orchestrator decides on is seconds old
        (tools/controller_scale.py measured a 6 s poll interval at 256 instances)."""
        slots = asyncio.Semaphore(max(1, self.concurrency))
        while not done.is_set():
            pushed = self.load_reports
            if pushed is not None:
                await self._apply_reports(pushed.take_reports())
            polls = [self._poll_stats(iid, engine, slots) for iid, engine in list(self.engines.items())
                     if not self._is_failed(iid)  # instances may join meanwhile
                     and (pushed is None or not pushed.covers(engine))]
            if polls:
                await asyncio.gather(*polls)
            self.events.post(Tick())
            if self.on_sweep is not None:
                self.on_sweep()
            try:
                await asyncio.wait_for(done.wait(), timeout=self.observability.stats_interval_s)
            except asyncio.TimeoutError:
                pass
