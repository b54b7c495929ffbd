"""Engine supervision with tiny stand-in processes (no model): restart, rejoin, restart budget."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from types import SimpleNamespace

from dora_megatron.processes import ProcessSet
from dora_megatron.launch.supervise import EngineSupervisor, RestartPolicy
from tests.helpers.fakes import FakeRuntime
from tests.helpers.servers import HEALTHY

CRASHES = "import sys; sys.exit(3)"


def _start(procs: ProcessSet, name: str, script: str, port: int = 1):
    return procs.start(name, [sys.executable, "-c", script, "--port", str(port)])


def test_restart_keeps_place_env_and_log(tmp_path):
    with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
        a = _start(procs, "a", "import time; time.sleep(60)")
        _start(procs, "b", "import time; time.sleep(60)")
        new = procs.restart("a", [sys.executable, "-c", "import time; time.sleep(60)", "--port", "2"])
        assert [c.name for c in procs.children] == ["a", "b"] and procs.children[0] is new
        assert a.popen.poll() is not None and new.alive() and new.popen.pid != a.popen.pid
        assert new.argv[-1] == "2"
    assert "restarted by the launcher" in (tmp_path / "logs" / "a.log").read_text()


def test_killed_engine_is_restarted_on_a_new_port_and_rejoins(tmp_path):
    async def main():
        with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
            old = _start(procs, "engine0", HEALTHY, port=0)  # port 0: it only has to die
            rt = FakeRuntime(["engine0"])
            sup = EngineSupervisor(procs, rt, RestartPolicy(max_restarts=2, startup_timeout_s=30),
                                   make_engine=lambda url: url, engine_names=["engine0"], poll_s=0.05)
            assert rt.pool.engine_restarts == 0
            task = asyncio.get_running_loop().create_task(sup.run())
            os.kill(old.popen.pid, signal.SIGKILL)
            for _ in range(400):
                if rt.added:
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return rt, procs.children[0]

    rt, child = asyncio.run(main())
    assert len(rt.added) == 1 and rt.pool.engine_restarts == 1 and not rt.down
    assert rt.tasks.error is None  # losing its only instance for a moment did not end the run
    name, url = rt.added[0]
    assert name == "engine0" and url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert child.argv[-1] == url.rsplit(":", 1)[1]


def test_restart_budget_is_respected(tmp_path):
    async def main():
        with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
            _start(procs, "engine0", CRASHES)
            rt = FakeRuntime(["engine0"])
            sup = EngineSupervisor(procs, rt, RestartPolicy(max_restarts=2, startup_timeout_s=30),
                                   make_engine=lambda url: url, engine_names=["engine0"], poll_s=0.05)
            task = asyncio.get_running_loop().create_task(sup.run())
            for _ in range(400):
                if sup.attempts.get("engine0") == 2 and not sup._restarting:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # several more checks: no third attempt
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return rt, sup

    rt, sup = asyncio.run(main())
    assert sup.attempts == {"engine0": 2}
    assert rt.added == [] and rt.down == {"engine0"} and rt.pool.engine_restarts == 0
    # its only instance is gone for good: the run is ended with a message, not left waiting
    assert rt.tasks.is_done() and "no restart is left" in str(rt.tasks.error)


def test_disabled_policy_only_reports_failures(tmp_path):
    async def main():
        with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
            _start(procs, "engine0", CRASHES)
            rt = FakeRuntime(["engine0"])
            sup = EngineSupervisor(procs, rt, RestartPolicy(enabled=False), make_engine=lambda url: url,
                                   engine_names=["engine0"], poll_s=0.05)
            task = asyncio.get_running_loop().create_task(sup.run())
            for _ in range(600):  # until the crash is seen (a loaded machine starts Python slowly)
                if rt.down:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # several more checks: still no restart
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return rt, sup

    rt, sup = asyncio.run(main())
    assert rt.down == {"engine0"} and sup.attempts == {} and rt.pool.engine_restarts is None


def test_all_failed_waits_for_instances_on_other_nodes_then_ends_the_run(tmp_path):
    """SLURM: an instance that is not this launcher's child (another node restarts it) may rejoin, so
    'every instance failed' ends the run only after rollout.startup_timeout_s (before: at once)."""
    async def main(come_back: bool):
        with ProcessSet(tmp_path / f"logs{come_back}", grace_s=2) as procs:
            rt = FakeRuntime(["remote0"])
            rt.down.add("remote0")
            sup = EngineSupervisor(procs, rt, RestartPolicy(max_restarts=1, startup_timeout_s=1.0),
                                   make_engine=lambda url: url, engine_names=["remote0"], poll_s=0.05)
            sup.check()
            assert not rt.tasks.is_done()  # its node may still bring it back
            if come_back:
                rt.add_instance("remote0", "client-2")
            await asyncio.sleep(1.2)
            sup.check()
            return rt

    rt = asyncio.run(main(come_back=True))
    assert rt.tasks.error is None and not rt.tasks.is_done()
    rt = asyncio.run(main(come_back=False))
    assert rt.tasks.is_done() and "remote0" in str(rt.tasks.error) and "startup_timeout_s" in str(rt.tasks.error)


def test_a_restarted_engine_is_polled_on_the_configured_health_path():
    """``vllm.health_path`` (RestartPolicy.health_path) is what a restart waits on, not a fixed /health."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    class Alive:
        def alive(self):
            return True

    class Runtime:
        pool = SimpleNamespace(engine_restarts=0)

    async def go():
        app = web.Application()
        app.router.add_get("/ready", lambda _req: web.Response(text="ok"))
        async with TestServer(app, host="127.0.0.1") as server:
            url = str(server.make_url("")).rstrip("/")
            on_path = EngineSupervisor(None, Runtime(), RestartPolicy(startup_timeout_s=5, health_path="/ready"),
                                       make_engine=lambda u: u, engine_names=[])
            default = EngineSupervisor(None, Runtime(), RestartPolicy(startup_timeout_s=1), make_engine=lambda u: u,
                                       engine_names=[])
            return await on_path._healthy(url, Alive()), await default._healthy(url, Alive())

    assert asyncio.run(go()) == (True, False)
