"""Whole ``dora train`` jobs on ``configs/cpu_tiny.yaml`` as subprocesses for the fault tests: start one,
wait on its records, kill its controller, check a resumed run's one record of exactly-once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
BASE = ["run.steps=8", "model.warm_start_steps=10", "orchestrator.tbs=4", "orchestrator.rbs=8",
        "orchestrator.max_staleness=1", "orchestrator.group_size=2", "observability.progress=false",
        "observability.timeline=false", "observability.heldout_prompts=0", "rollout.max_new_tokens=48"]


def _default_sigint() -> None:
    # a job started in the background (`cmd &`, as CI may run this suite) inherits SIGINT ignored,
    # and Python then installs no KeyboardInterrupt handler: give the launcher a terminal's default
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_train(run_dir: Path, *overrides: str, resume: bool = False, config: Path = ROOT / "configs" / "cpu_tiny.yaml",
                base: tuple[str, ...] = tuple(BASE)) -> subprocess.Popen:
    """``config`` with ``base`` and ``overrides`` set (or ``--resume`` of ``run_dir``)."""
    cmd = [sys.executable, "-m", "dora_megatron", "train"]
    if resume:
        cmd += ["--resume", str(run_dir)]
    else:
        cmd += ["--config", str(config), "--set", f"run.run_dir={run_dir}"]
    for o in (*base, *overrides):
        cmd += ["--set", o]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=run_dir.parent,
                            preexec_fn=_default_sigint)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timeout waiting for {what}")
        time.sleep(interval_s)


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


def check_resumed_run(run_dir: Path, n: int) -> tuple[dict, list[dict], dict[int, list[str]], dict[int, list[int]]]:
    """A run resumed after a crash ended whole: ``n`` steps, nothing lost, duplicated or off-version,
    and each group of the final lineage (the last record of each step: steps after the checkpoint
    were re-done) consumed exactly once. Returns the summary, the ``consumed.jsonl`` records and
    per step the final groups and their versions."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == n and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0
    records = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_text().splitlines()]
    # the record a resume continues holds each step of the final lineage once (the crashed
    # lineage's records after the checkpoint were dropped), and the summary counts from it
    assert [r["step"] for r in records] == list(range(n))
    lineage: dict[int, list[str]] = {}
    final_versions: dict[int, list[int]] = {}
    for rec in records:
        lineage[rec["step"]] = rec["groups"]
        final_versions[rec["step"]] = rec["versions"]
    assert sorted(lineage) == list(range(n))
    groups = [g for s in range(n) for g in lineage[s]]
    assert len(groups) == len(set(groups)) == n * 4
    # steps re-done after the checkpoint replaced the crashed lineage's records: each step once
    assert [json.loads(line)["step"] for line in (run_dir / "steps.jsonl").read_text().splitlines()] == list(range(n))
    if (run_dir / "tb").is_dir():
        from tests.helpers.tensorboard_read import read_scalar_tags

        assert [step for step, _ in read_scalar_tags(run_dir / "tb")["reward/mean"]] == list(range(n))
    return summary, records, lineage, final_versions


def kill_controller(run_dir: Path, proc: subprocess.Popen) -> None:
    """SIGKILL the job's controller; every child follows its parent (no orphans holding ports)."""
    pids = json.loads((run_dir / "processes.json").read_text())
    os.kill(pids["controller"], signal.SIGKILL)  # the whole job loses its controller
    proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for k, p in pids.items() if k != "controller"), 60, "children to exit")


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out
