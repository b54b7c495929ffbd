"""Stats polling: one sweep asks every instance at once (bounded), not one after the other.

WHY it matters: asked in turn, a sweep over N instances takes N round trips, so at cluster scale
the loads the orchestrator balances on are seconds old (tools/controller_scale.py: a 6 s poll
interval at 256 instances with stats_interval_s 0.5).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.data.reward_api import ThreadScorer

from tests.helpers.fakes import FakeEngine, FakeTrainer
from tests.helpers.runtime import NO_RUN_DIR

POLL_S = 0.2  # one stats round trip of a slow instance


class SlowStatsEngine(FakeEngine):
    """Answers ``server_info`` after ``POLL_S``; records when each poll started."""

    def __init__(self, name: str, polls: list[tuple[str, float]]) -> None:
        super().__init__(name, token_s=0.02)
        self.polls = polls

    async def server_info(self) -> dict[str, Any]:
        self.polls.append((self.name, time.monotonic()))
        await asyncio.sleep(POLL_S)
        return await super().server_info()


class StallingStatsEngine(FakeEngine):
    """``server_info`` answers only after ``stall_s`` for its first ``stalls`` polls: what a healthy
    instance looks like to a controller whose loop lags (its answer is read too late)."""

    def __init__(self, name: str, stalls: int, stall_s: float = 2.0) -> None:
        super().__init__(name, token_s=0.02)
        self.stalls, self.stall_s = stalls, stall_s
        self.answered = 0  # polls answered after the stalls

    async def server_info(self) -> dict[str, Any]:
        if self.stalls > 0:
            self.stalls -= 1
            await asyncio.sleep(self.stall_s)
        out = await super().server_info()
        self.answered += 1
        return out


def make_runtime(engines: dict, concurrency: int = 64, health_timeout_s: float = 30.0) -> Runtime:
    names = list(engines)
    cfg = OrchestratorConfig(mode="dora", tbs=4, rbs=8, max_staleness=1, group_size=2, rebalance_interval_s=0.05)
    rt = Runtime(Orchestrator(cfg, names), engines, FakeTrainer(engines=engines), RunningSumTask(1, 30, 1.2, seed=1),
                 ThreadScorer(running_sum_reward).score_sync, run=RunConfig(steps=3, seed=0), paths=NO_RUN_DIR,
                 controller=ControllerConfig(health_timeout_s=health_timeout_s),
                 observability=ObservabilityConfig(stats_interval_s=0.01), events=EventQueue())
    rt.stats.concurrency = concurrency  # not a config key: the poller's own bound (STATS_CONCURRENCY)
    return rt


def finish(rt: Runtime) -> dict[str, Any]:
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert len(rt.metrics.rows) == 3
    return summary


def run(n: int, concurrency: int) -> list[tuple[str, float]]:
    polls: list[tuple[str, float]] = []
    rt = make_runtime({f"e{i}": SlowStatsEngine(f"e{i}", polls) for i in range(n)}, concurrency)
    finish(rt)
    assert not rt.pool.failed_ever
    return polls


def first_sweep(polls: list[tuple[str, float]], n: int) -> list[float]:
    """Start times of each instance's first poll."""
    first: dict[str, float] = {}
    for name, t in polls:
        first.setdefault(name, t)
    assert len(first) == n, f"only {sorted(first)} of {n} instances were polled"
    return sorted(first.values())


def test_one_sweep_polls_every_instance_concurrently():
    n = 8
    starts = first_sweep(run(n, concurrency=64), n)
    # in turn, the last first poll would start (n - 1) * POLL_S = 1.4 s after the first
    assert starts[-1] - starts[0] < 3 * POLL_S


def test_polls_in_flight_are_bounded_by_stats_concurrency():
    n = 8
    starts = first_sweep(run(n, concurrency=2), n)
    # two at a time: the 8 first polls take at least 4 rounds of POLL_S
    assert starts[-1] - starts[0] >= 3 * POLL_S * 0.9


def test_one_stats_timeout_does_not_fail_a_healthy_instance():
    """Before: the first late answer failed the instance (a false failure under loop lag)."""
    engines = {"e0": StallingStatsEngine("e0", stalls=1), **{f"e{i}": FakeEngine(f"e{i}") for i in (1, 2)}}
    rt = make_runtime(engines, health_timeout_s=0.5)
    # the run lasts until e0 answered again (or 10 s): the short run must not end before the stall
    rt.trainer.hold_step(1, until=lambda: engines["e0"].answered > 0 or "e0" in rt.pool.failed_ever)
    finish(rt)
    assert not rt.pool.failed_ever


def test_an_instance_whose_polls_keep_timing_out_is_failed():
    engines = {"e0": StallingStatsEngine("e0", stalls=10**6), **{f"e{i}": FakeEngine(f"e{i}") for i in (1, 2)}}
    rt = make_runtime(engines, health_timeout_s=0.3)
    rt.trainer.hold_step(1, until=lambda: "e0" in rt.pool.failed_ever)
    finish(rt)
    assert rt.pool.failed_ever == {"e0"}


class NoPollEngine(FakeEngine):
    """An engine whose load comes pushed: a poll of it is a bug."""

    async def server_info(self) -> dict[str, Any]:
        raise AssertionError(f"{self.name} was polled although its load reports are pushed")


class PushedReports:
    """A load-report source covering ``covered``: reports them every take (``e0`` failed from ``fail_at``)."""

    def __init__(self, engines: dict, covered: set[str], fail_at: int | None = None) -> None:
        self.engines, self.covered, self.fail_at = engines, covered, fail_at
        self.takes = 0

    def covers(self, engine) -> bool:
        return any(engine is self.engines[n] for n in self.covered)

    def take_reports(self) -> dict:
        self.takes += 1
        out: dict = {self.engines[n]: {"num_running_reqs": 0, "kv_usage": 0.0} for n in sorted(self.covered)}
        if self.fail_at is not None and self.takes >= self.fail_at:
            out[self.engines["e0"]] = ("failed", "pushed: e0 does not answer")
        return out


def test_pushed_load_reports_replace_the_polls_of_the_engines_they_cover():
    polls: list[tuple[str, float]] = []
    engines = {"e0": NoPollEngine("e0"), "e1": NoPollEngine("e1"), "e2": SlowStatsEngine("e2", polls)}
    rt = make_runtime(engines)
    rt.stats.load_reports = source = PushedReports(engines, {"e0", "e1"})
    finish(rt)
    assert not rt.pool.failed_ever and source.takes > 0
    assert {n for n, _ in polls} == {"e2"}  # the uncovered engine is still polled


def test_a_pushed_failure_fails_the_instance_and_its_work_moves():
    engines = {f"e{i}": NoPollEngine(f"e{i}") for i in range(3)}
    rt = make_runtime(engines)
    rt.stats.load_reports = PushedReports(engines, set(engines), fail_at=3)
    rt.trainer.hold_step(1, until=lambda: "e0" in rt.pool.failed_ever)
    finish(rt)  # nothing lost or duplicated
    assert rt.pool.failed_ever == {"e0"}
