"""The faults the embedded engine is tested with (tests/integration/test_faults.py), on real SGLang
0.5.23 servers started by dora's launcher from ``configs/cpu_sglang.yaml``: a server SIGKILLed
during the job's startup and one SIGKILLed mid-run (each restarted by the launcher, it rejoins,
nothing is lost), a server that hangs (SIGSTOP of its process group: the socket accepts, nothing
answers; the stats poll fails it, the launcher replaces it), and ``--resume`` after the whole job
is SIGKILLed (every group of the final lineage consumed exactly once, no SGLang process left).

Opt-in tier (marker ``sglang``, ``DORA_SGLANG=1``; a failure under ``CI=true`` without the venv of
``tools/setup_sglang_cpu.sh``). WHY two jobs for four faults: a real server starts in 30-60 s on
two cores, so each job is a few steps of short answers and carries two faults, each checked on
its own (the fault happened: the old pid is gone, the log says so; and its consequence).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.helpers.fault_jobs import alive, check_resumed_run, kill_controller, start_train, steps_done, wait_for
from tests.helpers.proc_tree import process_tree, signal_tree

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

#: a few steps of short answers (tbs=4 groups of 2), a short warm start; two servers of one thread
SHORT = ("model.warm_start_steps=10", "orchestrator.tbs=4", "orchestrator.rbs=8", "orchestrator.max_staleness=1",
         "orchestrator.group_size=2", "rollout.max_new_tokens=24", "observability.progress=false",
         "observability.timeline=false", "observability.heldout_prompts=0", "observability.tensorboard=false",
         "observability.overview=false",
         "controller.trainer_timeout_s=600")  # the trainer is held (SIGSTOP) while a server restarts
BOUND_S = 420  # a real server starts in 30-60 s here; a restart is one more start


@pytest.fixture(scope="module")
def sglang_job():
    """``start_train`` on ``configs/cpu_sglang.yaml`` with the tier's SGLang interpreter."""
    from tests.helpers.sglang_real import CPU_CONFIG, require_sglang

    python = require_sglang()

    def start(run_dir: Path, *overrides: str, resume: bool = False):
        return start_train(run_dir, *overrides, resume=resume, config=CPU_CONFIG,
                           base=(*SHORT, f"sglang.python={python}"))
    return start


class Output:
    """A job's output, read as it comes (the controller logs to it; a full pipe would stall the job)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout_s: float) -> str:
        self.proc.wait(timeout=timeout_s)
        self.thread.join(timeout=30)
        assert self.proc.returncode == 0, self.text()[-4000:]
        return self.text()


def pids_of(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "processes.json").read_text())


def engine_log(run_dir: Path, name: str) -> str:
    return (run_dir / "logs" / f"{name}.log").read_text(errors="replace")


def check_whole(run_dir: Path, n: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == n and summary["consumed_groups"] == n * 4
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    groups = [g for line in (run_dir / "consumed.jsonl").read_text().splitlines() for g in json.loads(line)["groups"]]
    assert len(groups) == len(set(groups)) == n * 4
    return summary


def test_servers_sigkilled_at_startup_and_mid_run_are_restarted_and_rejoin(sglang_job, tmp_path):
    """engine0 is SIGKILLed (its whole process group: the HTTP server, scheduler and detokenizer)
    while the launcher waits for the instances; engine1 once training runs, with the trainer held
    (SIGSTOP) until the restarted engine1 has rejoined, so steps remain for it to serve."""
    run_dir = tmp_path / "run"
    n = 4
    proc = sglang_job(run_dir, f"run.steps={n}", "run.checkpoint_interval=0")
    job = Output(proc)
    held: list[int] = []
    try:
        wait_for(lambda: (run_dir / "processes.json").is_file(), 120, "the servers to start", proc)
        first = pids_of(run_dir)
        at_startup = not (run_dir / "steps.jsonl").exists()  # opened once the wait for instances is over
        os.killpg(first["engine0"], signal.SIGKILL)
        wait_for(lambda: steps_done(run_dir) >= 1, BOUND_S, "a first step", proc)
        before = pids_of(run_dir)
        held = process_tree(before["trainer"])
        signal_tree(held, signal.SIGSTOP)
        stopped_at = steps_done(run_dir)
        os.killpg(before["engine1"], signal.SIGKILL)
        wait_for(lambda: "instance engine1 rejoined the pool" in job.text(), BOUND_S,
                 "engine1 to be restarted and rejoin", proc)
        assert steps_done(run_dir) <= stopped_at + 1  # (a step may have been finishing when it stopped)
        signal_tree(held, signal.SIGCONT)
        held = []
        out = job.finish(BOUND_S)
    finally:
        signal_tree(held, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert at_startup
    assert "engine0 failed while the job starts (exited with status -9" in out, out[-4000:]
    summary = check_whole(run_dir, n)
    assert {"engine1"} <= set(summary["failed_instances"])
    assert summary["engine_restarts"] >= 2 and summary["instances_rejoined"] >= 1
    assert summary["samples_after_rejoin"] > 0
    for name in ("engine0", "engine1"):
        assert "restarted by the launcher" in engine_log(run_dir, name)
        assert pids_of(run_dir)[name] != first[name]
    assert not any(alive(p) for p in pids_of(run_dir).values())  # stopped with the job


def test_hung_server_is_replaced_then_resume_after_a_job_kill_consumes_every_group_once(sglang_job, tmp_path):
    """engine1's process group is stopped (SIGSTOP) once training runs, the trainer held until the
    launcher has replaced it; after the checkpoint of step 2 the whole job is SIGKILLed (every
    process, SGLang's scheduler and detokenizer children included, must go), then resumed."""
    run_dir = tmp_path / "run"
    n = 12  # steps after the checkpoint of step 2 keep the job running until the kill lands
    args = (f"run.steps={n}", "run.checkpoint_interval=2", "controller.health_timeout_s=5")
    proc = sglang_job(run_dir, *args)
    job = Output(proc)
    held: list[int] = []
    hung: list[int] = []
    try:
        wait_for(lambda: steps_done(run_dir) >= 1, BOUND_S, "a first step", proc)
        before = pids_of(run_dir)
        held = process_tree(before["trainer"])
        signal_tree(held, signal.SIGSTOP)
        hung = process_tree(before["engine1"])
        os.killpg(before["engine1"], signal.SIGSTOP)
        wait_for(lambda: "instance engine1 rejoined the pool" in job.text(), BOUND_S,
                 "the hung engine1 to be replaced and rejoin", proc)
        replaced = pids_of(run_dir)["engine1"] != before["engine1"] and not any(alive(p) for p in hung)
        signal_tree(held, signal.SIGCONT)
        held = []
        wait_for(lambda: any((run_dir / "checkpoints").glob("v000002/controller.json")) and steps_done(run_dir) >= 3,
                 BOUND_S, "the checkpoint of step 2 and a step after it", proc)
        tree = [p for pid in pids_of(run_dir).values() for p in process_tree(pid)]
        kill_controller(run_dir, proc)
        wait_for(lambda: not any(alive(p) for p in tree), 60, "every process of the job to exit")
        job.thread.join(timeout=30)
    finally:
        signal_tree(held, signal.SIGCONT)
        signal_tree(hung, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    # the stats poll failed it (the HTTP server of a stopped group accepts and never answers), the
    # launcher killed the stopped processes and started engine1 again
    assert "instance engine1 failed: server_info did not answer within 5 s" in job.text(), job.text()[-4000:]
    assert replaced
    crashed = steps_done(run_dir)
    resumed = sglang_job(run_dir, *args, resume=True)
    try:
        out = Output(resumed).finish(BOUND_S)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert crashed >= 3 and f"resuming {run_dir} from v" in out
    check_resumed_run(run_dir, n)
