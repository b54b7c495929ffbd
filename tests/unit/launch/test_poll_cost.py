"""The launchers' pollers (supervision, elastic joins) ask the runtime about the instances they look at,
O(1) each, never for the whole failed set: at 4,096 instances a pool scan per poll (and per child or
join request) is what they must not do. A real Runtime over an orchestrator that counts its
``is_alive`` calls shows it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.launch.elastic import JoinRequest, watch_joins, write_join_request
from dora_megatron.launch.supervise import EngineSupervisor, RestartPolicy
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers import fakes
from tests.helpers.runtime import NO_RUN_DIR


POOL = 4096


class CountingOrchestrator(Orchestrator):
    asked = 0

    def is_alive(self, instance: str) -> bool:
        self.asked += 1
        return super().is_alive(instance)


def _runtime(n: int) -> Runtime:
    names = [f"engine{i}" for i in range(n)]
    cfg = OrchestratorConfig(mode="dora", tbs=4, rbs=8, max_staleness=2, group_size=2)
    engines = {n: fakes.FakeEngine(n, migration=False) for n in names}
    return Runtime(CountingOrchestrator(cfg, names), engines, fakes.FakeTrainer(), RunningSumTask(1, 30, 1.2, seed=1),
                   ThreadScorer(running_sum_reward).score_sync, run=RunConfig(steps=1, seed=0), paths=NO_RUN_DIR,
                   rollout=RolloutConfig(max_new_tokens=8), events=EventQueue())


class _Child:
    def __init__(self, name: str, alive: bool, pid: int) -> None:
        self.name, self._alive = name, alive
        self.popen = SimpleNamespace(pid=pid, returncode=None if alive else 1)

    def alive(self) -> bool:
        return self._alive


def test_a_supervision_poll_asks_about_its_children_not_the_pool():
    rt = _runtime(POOL)
    children = [_Child("engine7", alive=True, pid=101), _Child("engine9", alive=False, pid=102)]
    sup = EngineSupervisor(SimpleNamespace(children=children), rt, RestartPolicy(max_restarts=1),
                           make_engine=lambda url: url, engine_names=[c.name for c in children])

    async def main():
        rt.orch.on_instance_failed("engine9")  # the runtime's view: engine9 failed, its process exited
        rt.orch.asked = 0
        sup.check()
        restarting = dict(sup._restarting)
        for task in restarting.values():  # the restart itself is not what this test is about
            task.cancel()
        await asyncio.gather(*restarting.values(), return_exceptions=True)
        return restarting

    restarting = asyncio.run(main())
    assert list(restarting) == ["engine9"]  # the failed instance is restarted, the live one is not
    assert not rt.tasks.is_done()
    assert rt.orch.asked <= 4, f"one poll asked is_alive {rt.orch.asked} times for {POOL} instances"


def test_an_elastic_poll_asks_once_per_join_request(tmp_path):
    rt = _runtime(POOL)
    for i in range(3):  # live instances announcing themselves again: nothing to do
        write_join_request(tmp_path, JoinRequest(f"engine{i}", f"http://h:{i}"))
    write_join_request(tmp_path, JoinRequest("new0", "http://h:9"))  # read last (names are sorted)
    probed = asyncio.Event()

    async def probe(engine) -> bool:
        probed.set()
        return False  # not reachable yet: it would be tried again at the next poll

    async def main():
        rt.orch.asked = 0
        watcher = asyncio.get_running_loop().create_task(
            watch_joins(tmp_path, rt, lambda req: fakes.FakeEngine(req.name, migration=False), poll_s=3600, probe=probe))
        try:
            await asyncio.wait_for(probed.wait(), timeout=60)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run(main())
    assert "new0" not in rt.engines  # (its probe failed)
    assert rt.orch.asked <= 4, f"one pass over 4 join requests asked is_alive {rt.orch.asked} times"


def test_all_failed_is_the_pools_state():
    rt = _runtime(3)
    assert not rt.pool.all_failed()
    rt.orch.on_instance_failed("engine0")
    rt.orch.on_instance_failed("engine1")
    assert not rt.pool.all_failed() and rt.pool.is_failed("engine1") and not rt.pool.is_failed("engine2")
    rt.orch.on_instance_failed("engine2")
    assert rt.pool.all_failed() and rt.pool.failed == {"engine0", "engine1", "engine2"}
