"""Faults on real processes: an engine SIGKILLed mid-run, the whole job SIGKILLed and resumed.

Each scenario checks the run summary (zero lost, zero duplicated groups, zero C1
violations) and, for the resume, the consumed-group log across the crash: every
group of the final lineage of steps is consumed exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BASE = ["run.steps=8", "model.warm_start_steps=10", "orchestrator.tbs=4", "orchestrator.rbs=8",
        "orchestrator.max_staleness=1", "orchestrator.group_size=2", "observability.progress=false",
        "observability.timeline=false", "rollout.max_new_tokens=48"]


def start_train(run_dir: Path, *overrides: str, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dora_megatron", "train"]
    if resume:
        cmd += ["--resume", str(run_dir)]
    else:
        cmd += ["--config", str(ROOT / "configs" / "cpu_tiny.yaml"), "--set", f"run.run_dir={run_dir}"]
    for o in (*BASE, *overrides):
        cmd += ["--set", o]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=run_dir.parent)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timeout waiting for {what}")
        time.sleep(0.2)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_engine_sigkill_mid_run_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "rollout.num_instances=3")
    try:
        wait_for(lambda: steps_done(run_dir) >= 2, 400, "two steps", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.kill(pids["engine1"], signal.SIGKILL)
        finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["consumed_groups"] == 32
    assert "engine1" in summary["failed_instances"]
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0


def test_job_sigkill_then_resume_consumes_every_group_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "run.checkpoint_interval=2")
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "v000002" / "controller.json").is_file() and steps_done(run_dir) >= 3,
                 400, "checkpoint v2 and three steps", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.kill(pids["controller"], signal.SIGKILL)  # the whole job loses its controller
        proc.wait(timeout=30)
        # every child follows its parent (no orphans holding ports)
        wait_for(lambda: not any(alive(p) for k, p in pids.items() if k != "controller"), 60, "children to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
    crashed_steps = steps_done(run_dir)
    resumed = start_train(run_dir, "run.checkpoint_interval=2", resume=True)
    out = finish(resumed)
    assert "resuming" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0
    # lineage: the last record of each step wins (steps after the checkpoint were re-done)
    lineage: dict[int, list[str]] = {}
    records = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert len(records) >= 8 + (crashed_steps - 2) - 1
    for rec in records:
        lineage[rec["step"]] = rec["groups"]
    assert sorted(lineage) == list(range(8))
    groups = [g for s in range(8) for g in lineage[s]]
    assert len(groups) == len(set(groups)) == 8 * 4
    # the steps before the checkpoint were not re-run
    first_two = [r for r in records if r["step"] < 2]
    assert len(first_two) == 2
