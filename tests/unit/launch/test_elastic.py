"""Elastic pools: an instance that joins a running job is switched to the version the orchestrator
assigns and takes work; a failed instance can come back under its name; nothing is lost."""

from __future__ import annotations

import asyncio

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.launch.elastic import JoinRequest, read_join_requests, watch_joins, write_join_request
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers import fakes
from tests.helpers.runtime import NO_RUN_DIR



def _runtime(names, steps=8):
    cfg = OrchestratorConfig(mode="dora", tbs=4, rbs=8, max_staleness=2, group_size=2, rebalance_interval_s=0.05,
                             cap_before_rebalance=6, cap_after_rebalance=4)
    engines = {n: fakes.FakeEngine(n, token_s=0.002, migration=False) for n in names}
    trainer = fakes.FakeTrainer()
    rt = Runtime(Orchestrator(cfg, names), engines, trainer, RunningSumTask(1, 30, 1.2, seed=1),
                 ThreadScorer(running_sum_reward).score_sync, run=RunConfig(steps=steps, seed=0), paths=NO_RUN_DIR,
                 observability=ObservabilityConfig(stats_interval_s=0.01), events=EventQueue())
    return rt, engines, trainer


def _check(rt, trainer, steps):
    assert len(trainer.batches) == steps
    seen = set()
    for step, batch in enumerate(trainer.batches):
        groups = {s.group_id for s in batch}
        assert len(groups) == 4 and not groups & seen
        seen |= groups
        assert all(s.reward == 1.0 and step - s.version <= 2 for s in batch)


async def _run_watched(rt, join_dir, make, event, **watch):
    """Run ``rt`` with a join watcher on ``join_dir`` and the coroutine ``event()`` beside it."""
    watcher = asyncio.get_running_loop().create_task(watch_joins(join_dir, rt, make, poll_s=0.01, **watch))
    asyncio.get_running_loop().create_task(event())
    try:
        return await drive(rt)
    finally:
        watcher.cancel()


def test_join_request_files_roundtrip(tmp_path):
    write_join_request(tmp_path, JoinRequest("x1", "http://h:1", 4))
    write_join_request(tmp_path, JoinRequest("x2", "http://h:2", 1, attempt=2, restarted_at=12.5))
    (tmp_path / "broken.json").write_text("{")
    assert read_join_requests(tmp_path) == [JoinRequest("x1", "http://h:1", 4),
                                            JoinRequest("x2", "http://h:2", 1, 2, 12.5)]


def test_joined_instance_gets_the_assigned_version_and_serves(tmp_path):
    rt, engines, trainer = _runtime(["e0", "e1"])
    joined = {}
    trainer.hold_step(7, lambda: "new0" in joined and any(op == "generate" for op, _, _ in joined["new0"].log))

    def make(req: JoinRequest):
        joined[req.name] = fakes.FakeEngine(req.name, token_s=0.002, migration=False)
        return joined[req.name]

    async def join_later():
        while len(trainer.batches) < 2:
            await asyncio.sleep(0.005)
        write_join_request(tmp_path, JoinRequest("new0", "http://unused"))

    summary = asyncio.run(_run_watched(rt, tmp_path, make, join_later))
    _check(rt, trainer, 8)
    new = joined["new0"]
    snapshots = f"{NO_RUN_DIR.run_dir}/weights/v"
    assert new.loads and new.loads[0].startswith(snapshots) and int(new.loads[0][len(snapshots):]) >= 2  # a current version
    assert any(op == "generate" for op, _, _ in new.log), "the joined instance never got work"
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_failed_instance_is_removed_and_can_rejoin():
    rt, engines, trainer = _runtime(["e0", "e1", "e2"])
    back = fakes.FakeEngine("e1", token_s=0.002, migration=False)
    trainer.hold_step(7, lambda: any(op == "generate" for op, _, _ in back.log))

    async def main():
        async def fail_then_rejoin():
            await fakes.fail_after_first_step(rt, trainer, engines["e1"], "e1")
            rt.add_instance("e1", back)
        asyncio.get_running_loop().create_task(fail_then_rejoin())
        return await drive(rt)

    summary = asyncio.run(main())
    _check(rt, trainer, 8)
    assert "e1" not in rt.pool.failed and back.loads and any(op == "generate" for op, _, _ in back.log)
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_a_restart_made_while_the_job_started_fails_no_one_and_still_brings_the_instance_back(tmp_path):
    """A node restarted e1 before the controller's start-up wait ended (``restarted_at`` before
    ``started_at``): the run started with that very process, so its join request must not fail the
    live e1 (it was failed at once, cancelling its first requests). The request stays pending: when
    e1 fails later, it brings e1 back."""
    rt, engines, trainer = _runtime(["e0", "e1"])
    made, before = [], []
    trainer.hold_step(7, lambda: bool(made))

    def make(req: JoinRequest):
        made.append(fakes.FakeEngine(req.name, token_s=0.002, migration=False))
        return made[-1]

    async def fail_later():
        while len(trainer.batches) < 4:
            await asyncio.sleep(0.005)
        before.append((rt.engines["e1"] is engines["e1"], rt.pool.is_failed("e1"), len(made)))
        rt.report_failure("e1", "its process died")

    write_join_request(tmp_path, JoinRequest("e1", "http://e1", attempt=1, restarted_at=999.0))
    summary = asyncio.run(_run_watched(rt, tmp_path, make, fail_later, started_at=1000.0))
    _check(rt, trainer, 8)
    assert before == [(True, False, 0)]  # 4 steps with the request there: e1 neither failed nor replaced
    assert [e.name for e in made] == ["e1"] and rt.engines["e1"] is made[0]
    assert summary["failed_instances"] == ["e1"] and summary["instances_rejoined"] == 1
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0


def test_instance_restarted_by_its_node_rejoins_even_before_the_controller_noticed(tmp_path):
    """SLURM rollout nodes restart a dead instance on the same URL and ask again with attempt+1.
    The controller may not have seen the old process fail yet (its URL answers again): the new
    attempt fails the old one (its requests re-run on their own version) and adds the new one, once;
    an attempt-0 request for a live instance changes nothing."""
    from dora_megatron.launch.elastic import heartbeat_age

    rt, engines, trainer = _runtime(["e0", "e1"])
    made = []
    trainer.hold_step(7, lambda: made and any(op == "generate" for op, _, _ in made[-1].log))

    def make(req: JoinRequest):
        made.append(fakes.FakeEngine(req.name, token_s=0.002, migration=False))
        return made[-1]

    async def main():
        watcher = asyncio.get_running_loop().create_task(watch_joins(tmp_path, rt, make, poll_s=0.01))

        async def restart_later():
            while len(trainer.batches) < 2:
                await asyncio.sleep(0.005)
            write_join_request(tmp_path, JoinRequest("e0", "http://e0"))  # live, attempt 0: ignored
            write_join_request(tmp_path, JoinRequest("e1", "http://e1", attempt=1))
        asyncio.get_running_loop().create_task(restart_later())
        try:
            return await drive(rt)
        finally:
            watcher.cancel()

    summary = asyncio.run(main())
    _check(rt, trainer, 8)
    assert [e.name for e in made] == ["e1"] and rt.engines["e1"] is made[0] and rt.engines["e0"] is engines["e0"]
    assert summary["instances_rejoined"] == 1 and summary["failed_instances"] == ["e1"]
    assert made[0].loads and any(op == "generate" for op, _, _ in made[0].log)
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    assert heartbeat_age(tmp_path) is not None and heartbeat_age(tmp_path) < 60  # the watcher's heartbeat
