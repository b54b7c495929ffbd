"""The start of a job with the instances that come up: the readiness decision (a pure function) and
the start-up wait on tiny stand-in processes (a crash with its own error line, a restart, a refusal)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from dora_megatron.launch.startup import (StartupRefused, StartupView, required_ready, startup_decision,
                                          wait_for_instances)
from dora_megatron.launch.supervise import RestartPolicy, restart_engine
from dora_megatron.ports import free_ports
from dora_megatron.processes import ProcessSet

from tests.helpers.servers import HEALTHY


def view(total=4, ready=(), loading=(), failed=None, retrying=(), elapsed=1.0, timeout=10.0) -> StartupView:
    return StartupView(total, frozenset(ready), frozenset(loading), dict(failed or {}), frozenset(retrying),
                       elapsed, timeout)


@pytest.mark.parametrize("spec,total,need", [(None, 8, None), (1, 8, 1), (8, 8, 8), (1.0, 8, 8), (0.5, 8, 4),
                                             (0.9, 4096, 3687), (0.01, 8, 1), (0.3, 10, 3)])
def test_required_ready_counts_and_fractions(spec, total, need):
    assert required_ready(spec, total) == need


@pytest.mark.parametrize("spec", [0, 9, 0.0, 1.5, True])
def test_required_ready_refuses_impossible_values_naming_the_key(spec):
    with pytest.raises(ValueError, match="launch.min_ready_instances"):
        required_ready(spec, 8)


def test_default_waits_for_every_instance_that_did_not_fail_then_starts_without_the_failed():
    assert not startup_decision(view(ready={"a", "b"}, loading={"c"}, failed={"d": "x"}, retrying={"d"}), None)
    # nothing is loading any more: start with the ready ones; d (failed, being restarted) joins later
    assert startup_decision(view(ready={"a", "b", "c"}, failed={"d": "x"}, retrying={"d"}), None)
    assert startup_decision(view(ready={"a"}, failed={"b": "x", "c": "y", "d": "z"}), None)


def test_default_with_none_ready_waits_for_restarts_then_refuses_at_the_timeout():
    failed = {"a": "exited with status -9", "b": "exited with status 1: ValueError: bad shard"}
    assert not startup_decision(view(total=2, failed=failed, retrying={"a"}), None)
    with pytest.raises(StartupRefused) as err:
        startup_decision(view(total=2, failed=failed, retrying={"a"}, elapsed=10.0), None)
    msg = str(err.value)
    assert "only 0 of 2" in msg and "rollout.startup_timeout_s=10 s" in msg
    assert "a: exited with status -9" in msg and "b: exited with status 1: ValueError: bad shard" in msg


def test_default_at_the_timeout_starts_without_the_slow_ones():
    assert startup_decision(view(ready={"a"}, loading={"b", "c", "d"}, elapsed=10.0), None)


def test_a_count_starts_as_soon_as_it_is_met_and_waits_for_restarts_until_then():
    assert startup_decision(view(ready={"a", "b"}, loading={"c", "d"}), 2)
    assert startup_decision(view(ready={"a", "b"}, loading={"c", "d"}), 0.5)
    # 4 of 4 needed, one failed and is being restarted: wait for it
    assert not startup_decision(view(ready={"a", "b", "c"}, failed={"d": "x"}, retrying={"d"}), 4)


def test_a_count_that_can_no_longer_be_met_is_refused_at_once_naming_the_failed():
    with pytest.raises(StartupRefused) as err:
        startup_decision(view(ready={"a", "b", "c"}, failed={"d": "exited with status -9 (log d.log)"}), 1.0)
    msg = str(err.value)
    assert "only 3 of 4" in msg and "no restart is left" in msg and "needs 4" in msg
    assert "d: exited with status -9 (log d.log)" in msg


def test_a_count_not_met_at_the_timeout_names_the_loading_and_the_failed():
    with pytest.raises(StartupRefused) as err:
        startup_decision(view(ready={"a"}, loading={"b"}, failed={"c": "exited with status 3"}, retrying={"c"},
                              elapsed=12.0), 3)
    msg = str(err.value)
    assert "only 1 of 4" in msg and "within rollout.startup_timeout_s=10 s" in msg
    assert "b: not healthy after 12 s (still loading)" in msg and "c: exited with status 3" in msg


CRASH_WITH_ERROR = "raise ValueError('shard 3 of the weights is missing')"


def _run(coro):
    return asyncio.run(coro)


def _one_healthy_one_crashing(procs: ProcessSet) -> tuple[int, int, dict[str, str]]:
    """Start e0 (serves /health) and e1 (exits at once with an error line); their ports and urls."""
    p0, p1 = free_ports(2)
    procs.start("e0", [sys.executable, "-c", HEALTHY, "--port", str(p0)])
    procs.start("e1", [sys.executable, "-c", CRASH_WITH_ERROR, "--port", str(p1)])
    return p0, p1, {"e0": f"http://127.0.0.1:{p0}", "e1": f"http://127.0.0.1:{p1}"}


def test_a_crashed_instance_is_restarted_and_the_start_waits_for_a_count(tmp_path):
    """min 2 of 2: the crashed one is restarted (with a healthy command) and the start waits for it."""
    with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
        p0, p1, urls = _one_healthy_one_crashing(procs)
        policy = RestartPolicy(fixed_port=False)

        def restart(name):  # the second start of e1 serves (a transient failure)
            procs.children[1].argv = (sys.executable, "-c", HEALTHY, "--port", str(p1))
            return restart_engine(procs, name, policy)

        res = _run(wait_for_instances(urls, procs,
                                      min_ready=2, timeout_s=20, restart=restart, max_restarts=3, interval_s=0.1))
        assert res.ready == {"e0", "e1"} and res.absent == {} and res.attempts == {"e1": 1}
        assert res.urls["e1"] != f"http://127.0.0.1:{p1}"  # a fresh port (not fixed)


def test_default_starts_without_a_crashed_instance_naming_its_error_line(tmp_path):
    with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
        p0, p1, urls = _one_healthy_one_crashing(procs)
        res = _run(wait_for_instances(urls, procs,
                                      min_ready=None, timeout_s=20, restart=None, interval_s=0.1))
    assert res.ready == {"e0"} and set(res.absent) == {"e1"} and res.loading == set()
    assert "ValueError: shard 3 of the weights is missing" in res.absent["e1"]


def test_the_start_is_refused_when_no_restart_can_reach_the_minimum(tmp_path):
    with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
        p0, p1, urls = _one_healthy_one_crashing(procs)
        policy = RestartPolicy(fixed_port=True)
        with pytest.raises(StartupRefused) as err:  # every restart crashes the same way: 2 restarts, then out
            _run(wait_for_instances(urls, procs,
                                    min_ready=2, timeout_s=30, restart=lambda n: restart_engine(procs, n, policy),
                                    max_restarts=2, interval_s=0.1))
        assert procs.children[1].log_path.read_text().count("restarted by the launcher") == 2
    msg = str(err.value)
    assert "only 1 of 2" in msg and "e1: exited with status 1: ValueError: shard 3 of the weights is missing" in msg


def test_a_remote_instance_its_node_saw_fail_to_bind_is_reported_so_and_one_that_moved_is_followed(tmp_path):
    """Instances of other SLURM nodes are no children here: what their nodes published says where they
    are (a restart moved e0 to another port: followed) and why one is down (e1 could not bind: that,
    not "still loading", refuses the start)."""
    from dora_megatron.launch.addresses import Address, publish, url_resolver

    with ProcessSet(tmp_path / "logs", grace_s=2) as procs:
        (p0,) = free_ports(1)
        procs.start("server", [sys.executable, "-c", HEALTHY, "--port", str(p0)])  # e0's process, on its new port
        publish(tmp_path, Address("e0", "n2", p0, "7"))
        why = "exited with status 2: e1 cannot bind port 30000 on node n3 (0.0.0.0:30000): held by pid 4242 (slurmd -N n3)"
        publish(tmp_path, Address("e1", "n3", 30000, "7", failed=why, final=True))
        resolve = url_resolver(tmp_path, "7")
        templates = {"e0": "http://127.0.0.1:{port:e0}", "e1": "http://127.0.0.1:{port:e1}"}

        def locate(name):
            url, addr = resolve(templates[name])
            return url, addr.failed, addr.final

        with pytest.raises(StartupRefused) as err:
            _run(wait_for_instances(dict(templates), procs, min_ready=2, timeout_s=20, interval_s=0.1, locate=locate))
        msg = str(err.value)
        assert f"e1: {why}" in msg and "e1: not healthy" not in msg  # refused at once: e1 is down for good
        res = _run(wait_for_instances(dict(templates), procs, min_ready=1, timeout_s=20, interval_s=0.1, locate=locate))
    assert res.ready == {"e0"} and res.urls["e0"] == f"http://127.0.0.1:{p0}" and res.absent == {"e1": why}
