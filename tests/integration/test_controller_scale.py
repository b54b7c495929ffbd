"""The controller load harness at CI size: the real controller runtime (launcher wiring, SGLang
clients, stats polling, journal) against 32 fake SGLang instances and a fake trainer.

What is checked are the invariants (every group consumed exactly once, as both the controller and
the trainer count them; C1/C3 0; no instance declared failed), never timings: the machine may be
loaded. The second test proves the false-failure check can fail: a stats-poll timeout no answer
can meet makes healthy instances look dead, and the harness must say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "controller_scale.py"


def run_harness(tmp_path: Path, *extra: str, timeout_s: float = 240.0, instances: int = 32,
                steps: int = 3) -> tuple[int, dict, str]:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(TOOL), "--instances", str(instances), "--steps", str(steps), "--out", str(out),
                           "--step-s", "0.3", "--timeout-s", "150", *extra],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, result, proc.stdout + proc.stderr


def test_32_instances_exactly_once_no_false_failures(tmp_path):
    rc, r, log = run_harness(tmp_path)
    assert rc == 0, log[-3000:]
    assert r["instances"] == 32 and r["steps_done"] == 3
    assert r["invariant_violations"] == []
    assert r["false_instance_failures"] == 0
    assert r["lost_groups"] == 0 and r["duplicated_groups"] == 0
    assert r["c1_violations"] == 0 and r["c3_violations"] == 0
    # exactly once as the trainer saw it, independently of the controller's own counters
    assert r["trainer_repeated_groups"] == 0 and r["trainer_incomplete_groups"] == 0
    assert r["trainer_groups_seen"] == r["consumed_groups"] > 0
    # the measurement really ran: instances were polled and generated, a new version was loaded
    assert r["stats_polls"] >= 32 and r["generate_requests"] >= r["finished_samples"] > 0
    assert r["switched_instance_loads"] > 0
    for key in ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms", "cpu_s_per_1k_samples"):
        assert isinstance(r[key], float), key


def test_false_failures_are_reported(tmp_path):
    """A poll timeout of 1 µs fails every healthy instance: the harness must count them and exit 1."""
    rc, r, log = run_harness(tmp_path, "--set", "controller.health_timeout_s=0.000001")
    assert rc == 1, log[-3000:]
    assert r["false_instance_failures"] > 0
    assert any("false_instance_failures" in v for v in r["invariant_violations"])


def check_exactly_once(r: dict) -> None:
    assert r["lost_groups"] == 0 and r["duplicated_groups"] == 0
    assert r["c1_violations"] == 0 and r["c3_violations"] == 0
    assert r["trainer_repeated_groups"] == 0 and r["trainer_incomplete_groups"] == 0
    assert r["trainer_groups_seen"] == r["consumed_groups"] > 0


def test_64_instances_on_2_client_workers_exactly_once_no_false_failures(tmp_path):
    """rollout.client_workers: the instances' HTTP calls and stats polls run in 2 worker processes."""
    rc, r, log = run_harness(tmp_path, "--client-workers", "2", instances=64, steps=2)
    assert rc == 0, log[-3000:]
    assert r["client_workers"] == 2 and r["steps_done"] == 2 and r["invariant_violations"] == []
    assert r["false_instance_failures"] == 0
    check_exactly_once(r)
    # the workers did the HTTP work: every instance generated and was polled, a new version was loaded
    assert r["worker_cpu_s"] > 0 and r["generate_requests"] >= r["finished_samples"] > 0
    assert r["stats_polls"] >= 64 and r["switched_instance_loads"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 cores")
def test_pinned_controller_keeps_its_core_and_the_invariants(tmp_path):
    """--controller-cpus / --others-cpus (how the 4,096-instance table was measured): the controller
    keeps its core, the client workers it spawned are moved to the others' core, nothing is lost."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    rc, r, log = run_harness(tmp_path, "--client-workers", "2", "--controller-cpus", str(a), "--others-cpus", str(b),
                             instances=32, steps=2)
    assert rc == 0, log[-3000:]
    assert r["controller_cpus_seen"] == [a] and r["others_cpus"] == [b]
    assert r["worker_cpus"] == [[b], [b]]
    assert r["false_instance_failures"] == 0
    check_exactly_once(r)


def test_bad_core_list_is_refused_naming_the_flag(tmp_path):
    rc, _, log = run_harness(tmp_path, "--controller-cpus", "0,zz")
    assert rc == 2 and "--controller-cpus" in log and "'0,zz'" in log
    rc, _, log = run_harness(tmp_path, "--others-cpus", "4096")
    assert rc == 2 and "--others-cpus" in log and "4096" in log and "not available" in log


def test_a_killed_client_worker_loses_and_duplicates_nothing(tmp_path):
    """SIGKILL one of the 2 workers mid-run: its 32 instances fail (their requests run again
    elsewhere), the other 32 finish the run; every group is consumed once."""
    rc, r, log = run_harness(tmp_path, "--client-workers", "2", "--kill-worker-after-samples", "60",
                             instances=64, steps=2)
    assert rc == 0, log[-3000:]
    assert r["killed_worker_pid"] and r["killed_worker_instances"] == 32 == r["killed_worker_instances_failed"]
    assert r["false_instance_failures"] == 0 and r["steps_done"] == 2 and r["invariant_violations"] == []
    check_exactly_once(r)


def test_a_low_open_files_limit_makes_requests_wait_not_instances_fail(tmp_path):
    """The controller's open-files limit lowered to 300 once the fakes run: 48 instances x 8 slots
    cannot hold one socket per request (384 + polls + the reserve). Before, every generate failed
    with 'Too many open files' and all 48 instances were failed; now the pools are sized from the
    limit (1 generate + 2 control connections each), excess requests wait (counted), none fails."""
    rc, r, log = run_harness(tmp_path, "--controller-open-files", "300", instances=48, steps=2)
    assert rc == 0, log[-3000:]
    assert r["open_files_limit"] == 300 and r["steps_done"] == 2 and r["invariant_violations"] == []
    assert r["false_instance_failures"] == 0
    assert r["connection_waits"] > 0
    check_exactly_once(r)


def test_an_open_files_limit_too_low_to_run_is_refused_with_the_numbers(tmp_path):
    """Not one generate connection per instance fits in 150 descriptors (reserve 128): refused at
    start, naming the numbers and rollout.client_workers, before any request."""
    rc, _, log = run_harness(tmp_path, "--controller-open-files", "150", instances=48, steps=2)
    assert rc == 2, log[-3000:]
    assert "rollout.client_workers" in log and "150" in log and "48 instance(s) x 8 slot(s)" in log
