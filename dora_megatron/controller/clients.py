"""This process's clients of the rollout instances: its connection budget, one client per
instance (or the client worker processes of ``rollout.client_workers``), and their closing.

WHY apart from :mod:`.main`: the budget is checked twice, by a launcher before it starts any
process (a concurrency that cannot run is refused at once) and by the controller before it waits
on the instances; both must refuse alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from dora_megatron.comm.answer_reader import AnswerReader
from dora_megatron.config.schema import DoraConfig

from dora_megatron.controller.records import Engine

if TYPE_CHECKING:
    from dora_megatron.comm.limits import ConnectionPlan
    from dora_megatron.controller.main import Launcher, Started
    from dora_megatron.processes import ProcessSet
    from dora_megatron.rollout.sharded import ClientPool


def connection_plan(cfg: DoraConfig, instances: int, say: Callable[[str], None] | None = None) -> ConnectionPlan:
    """This process's connection budget for ``instances`` (:mod:`dora_megatron.comm.limits`): the
    soft open-files limit raised to the hard one (logged old -> new), each instance's pool sized
    from it. Refuses (:class:`~dora_megatron.config.base.ConfigError` naming
    ``rollout.client_workers`` and the numbers) when not one generate connection per instance
    fits; ``say``: where the warning goes when not every slot gets its own connection (requests
    then wait for one, counted as ``connection_waits``)."""
    from dora_megatron.comm.limits import (CONTROL_CONNECTIONS, MANY_IN_FLIGHT, ConnectionBudgetError,
                                           plan_connections, raise_open_files_limit)
    from dora_megatron.config.base import ConfigError

    old, new = raise_open_files_limit()
    if say is not None and new != old:
        say(f"open-files limit raised from {old} to {new} (the hard limit)")
    try:
        # rollout.speculative=group: the finished siblings' pushes get a connection of their own
        # (one push at a time per instance, controller/siblings.py), beside the polls' and aborts'
        control = CONTROL_CONNECTIONS + (cfg.rollout.speculative == "group")
        plan = plan_connections(instances, cfg.orchestrator.cap_before_rebalance, new,
                                client_workers=cfg.rollout.client_workers, control=control)
    except ConnectionBudgetError as err:
        raise ConfigError("rollout.client_workers", str(err)) from err
    if say is not None and not plan.fits:
        say(f"warning: {plan.describe()} of {plan.slots} slots; requests beyond them wait for a connection "
            f"(connection_waits in summary.json): raise the hard open-files limit or set rollout.client_workers")
    if say is not None and plan.client_workers == 0 and plan.in_flight > MANY_IN_FLIGHT:
        say(f"warning: up to {plan.in_flight} requests in flight in the controller's own process; each full garbage "
            f"collection scans all of them with its event loop stopped (up to 0.6 s at 8,192): "
            f"rollout.client_workers={-(-plan.in_flight // MANY_IN_FLIGHT)} or more runs them in worker processes "
            f"(docs/results/controller_scale.md)")
    return plan


class EngineClients:
    """The clients the controller makes for the instances (planned ones, restarted and joining ones
    alike). ``procs``: the launcher's processes, for clients that restart vLLM instances."""

    def __init__(self, cfg: DoraConfig, model_dir: Path, run_dir: Path, procs: ProcessSet | None, instances: int,
                 say: Callable[[str], None]) -> None:
        from dora_megatron.comm.limits import ConnectionWaits

        self.cfg, self.model_dir, self.run_dir, self.procs = cfg, model_dir, run_dir, procs
        self.plan = connection_plan(cfg, instances, say)  # refuses before waiting on thousands of instances
        self.waits = ConnectionWaits()
        # rollout.client_workers > 0: the instances' HTTP clients run in worker processes
        self.pool: ClientPool | None = None
        #: how this process's clients read big answers: the bytes read and decoded at once (the rest
        #: wait in the engines' sockets) and the one thread they are decoded in; closed by :meth:`close`
        self.reader = AnswerReader()

    async def start_pool(self) -> None:
        """The client worker processes (``rollout.client_workers``), if any; they push load reports."""
        cfg = self.cfg
        if cfg.rollout.client_workers > 0:
            from dora_megatron.controller.stats import STATS_CONCURRENCY
            from dora_megatron.rollout.sharded import ClientPool

            self.pool = await ClientPool.start(cfg, str(self.model_dir), cfg.rollout.client_workers,
                                               log_dir=self.run_dir / "logs", poll={
                "interval_s": cfg.observability.stats_interval_s, "health_timeout_s": cfg.controller.health_timeout_s,
                "concurrency": STATS_CONCURRENCY}, plan=self.plan)

    def make(self, url: str) -> Engine:
        """The client of the instance at ``url``."""
        from dora_megatron.rollout.factory import engine_for

        if self.pool is not None:
            return self.pool.engine(url)
        engine: Engine = engine_for(self.cfg, url, str(self.model_dir), self.procs, self.run_dir,
                                    plan=self.plan, waits=self.waits, reader=self.reader)
        return engine

    @property
    def connection_waits(self) -> Callable[[], int]:
        """This process's back-pressure count (calls that waited for a pooled connection): a function,
        read when the run's summary is written (the client workers report theirs)."""
        if self.pool is not None:
            return self.pool.connection_waits
        return lambda: self.waits.count

    async def close(self, engines: Mapping[str, Engine]) -> None:
        for e in engines.values():
            await e.close()
        if self.pool is not None:
            await self.pool.close()
        self.reader.close()  # the clients are closed: nothing is queued any more

    async def wait_ready(self, launcher: Launcher, urls: dict[str, str], trainer_url: str,
                         say: Callable[[str], None]) -> Started:
        """Until the launcher's processes answer (:meth:`~dora_megatron.controller.main.Launcher.wait_started`),
        saying which instances start later; SGLang instances' versions are checked then. Returns
        what the launcher knows of them (``urls``, ``ready``, ``absent``, ``loading``, ``attempts``)."""
        import time

        t_start = time.monotonic()
        say(f"waiting for {len(urls)} engines and the trainer ({self.cfg.launch.trainer_procs} rank(s)) ...")
        started = await launcher.wait_started(dict(urls), trainer_url)
        if started.absent:
            say(f"starting with {len(started.ready)} of {len(started.urls)} rollout instance(s) after "
                f"{time.monotonic() - t_start:.1f} s; the others join once ready: "
                + "; ".join(f"{n}: {why}" for n, why in sorted(started.absent.items())))
        else:
            say(f"all processes healthy after {time.monotonic() - t_start:.1f} s")
        if self.cfg.rollout.engine == "sglang":
            from dora_megatron.rollout.sglang.server import check_versions

            for warning in await check_versions([started.urls[n] for n in sorted(started.ready)]):
                say(f"warning: {warning}")
        return started
