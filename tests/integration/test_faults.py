"""Faults on real processes: an engine SIGKILLed mid-run (restarted, it rejoins), the trainer
SIGKILLed during its first checkpoint write and mid-step (restarted inside the job, no process
left behind), the whole job SIGKILLed and resumed (from the previous checkpoint, the newest one
being garbled), Ctrl-C /
SIGTERM / SIGUSR1 (a checkpoint at the next step boundary, then a resume; a second signal at once).

Each scenario checks the run summary (zero lost, zero duplicated groups, zero C1
violations) and, for the resume, the consumed-group log across the crash: every
group of the final lineage of steps is consumed exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from dora_megatron.controller.journal import read_journal
from tests.helpers.proc_tree import children, in_sessions, process_tree, sessions, signal_tree

from tests.helpers.fault_jobs import alive, check_resumed_run, finish, kill_controller, start_train, steps_done, wait_for

pytestmark = pytest.mark.integration


def test_engine_sigkill_mid_run_loses_nothing_and_the_engine_rejoins(tmp_path):
    run_dir = tmp_path / "run"
    n = 12
    proc = start_train(run_dir, "rollout.num_instances=3", f"run.steps={n}")
    trainer_stopped: list[int] = []
    try:
        wait_for(lambda: steps_done(run_dir) >= 2, 400, "two steps", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        # hold training (not rollout) until the engine is back, so that steps remain for it to serve
        trainer_stopped = process_tree(pids["trainer"])
        signal_tree(trainer_stopped, signal.SIGSTOP)
        stopped_at = steps_done(run_dir)
        os.kill(pids["engine1"], signal.SIGKILL)
        wait_for(lambda: json.loads((run_dir / "processes.json").read_text())["engine1"] != pids["engine1"],
                 120, "engine1 to be restarted and rejoin", proc)
        assert steps_done(run_dir) <= stopped_at + 1  # (a step may have been finishing when it stopped)
        signal_tree(trainer_stopped, signal.SIGCONT)
        trainer_stopped = []
        finish(proc)
    finally:
        signal_tree(trainer_stopped, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == n and summary["consumed_groups"] == n * 4
    assert "engine1" in summary["failed_instances"]
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    # the launcher restarted it (a new process), it rejoined the pool and served requests again
    assert summary["engine_restarts"] == 1 and summary["instances_rejoined"] == 1
    assert summary["samples_after_rejoin"] > 0
    new_pid = json.loads((run_dir / "processes.json").read_text())["engine1"]
    assert new_pid != pids["engine1"] and not alive(new_pid)  # stopped with the job
    assert "restarted by the launcher" in (run_dir / "logs" / "engine1.log").read_text()


def test_job_sigkill_then_resume_consumes_every_group_once(tmp_path):
    """Also: the newest checkpoint is garbled before the resume, which falls back to the previous one,
    and the samples the journal recorded as finished after that one are restored, not regenerated."""
    run_dir = tmp_path / "run"
    n = 12
    # one sample of each of a step's tbs=4 groups is dumped: the prompt each trained group was sent
    args = ("run.checkpoint_interval=2", f"run.steps={n}", "observability.dump_rollouts=4")
    proc = start_train(run_dir, *args)
    try:
        # overview.png is drawn at each checkpoint (off the loop): there before the run ends
        wait_for(lambda: steps_done(run_dir) >= 5 and (run_dir / "overview.png").is_file() and restorable(run_dir, 4, n),
                 400, "five steps, a checkpoint overview, and a journaled sample to restore", proc)
        assert (run_dir / "overview.png").read_bytes()[:4] == b"\x89PNG"
        kill_controller(run_dir, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    crashed_steps = steps_done(run_dir)
    done = sorted(p for p in (run_dir / "checkpoints").glob("v*") if (p / "controller.json").is_file())
    newest, previous = done[-1], done[-2]
    resumed_from = int(previous.name[1:])
    finished_after = read_journal(run_dir, resumed_from)  # finished after that checkpoint, by versions <= it
    shard = sorted((newest / "trainer").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:  # garbled in place (same size): torch would load it silently
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    resumed = start_train(run_dir, *args, resume=True)
    out = finish(resumed)
    assert f"checkpoint {newest} is corrupt" in out and shard.name in out
    assert f"falling back to the previous good checkpoint {previous}" in out
    assert f"resuming {run_dir} from {previous.name}" in out
    assert (run_dir / "checkpoints" / f"bad-{newest.name}").is_dir()
    assert crashed_steps > resumed_from  # the crashed lineage recorded steps after the checkpoint it resumes from
    summary, records, lineage, final_versions = check_resumed_run(run_dir, n)
    # the steps before the checkpoint it resumed from were not re-run
    before = [r for r in records if r["step"] < resumed_from]
    assert len(before) == resumed_from
    # write-ahead journal: samples finished after that checkpoint (by versions <= it) were restored, not
    # regenerated, exactly when their group came back with the same version (which groups do is the
    # resumed run's scheduling: in a rare run none does, and then nothing may be replayed). Here the
    # journaled samples are those of the groups dispatched at the checkpoint's version V right after
    # the cut (the rollout is ahead of the trainer, so the groups outstanding at the cut were complete);
    # the resumed run dispatches them at V again only if its fresh instances serve V before the
    # trainer's step V ends, else at V + 1, and then none is replayed
    replayed_file = run_dir / "replayed.jsonl"
    replayed = ({r["sample_id"]: r for r in map(json.loads, replayed_file.read_text().splitlines())}
                if replayed_file.is_file() else {})
    assert finished_after, "the crashed lineage journaled no finished sample after the checkpoint"
    assert summary["samples_from_journal"] == len(replayed)
    for sid, r in replayed.items():
        j = finished_after[sid]
        assert (r["group_id"], r["version"], r["prompt_index"], r["tokens"]) == (
            j.group_id, j.version, j.prompt_index, len(j.response_ids))
    final_version = {g: v for s in range(n) for g, v in zip(lineage[s], final_versions[s])}
    came_back = {sid for sid, j in finished_after.items() if final_version.get(j.group_id) == j.version}
    assert set(replayed) == came_back, "journaled samples whose group came back on their version were generated again"
    check_prompt_stream(run_dir, lineage, n)


def _held_in_spool(checkpoint: Path) -> set[str]:
    """The spool segments a checkpoint's samples name (``routed_at``)."""
    state = json.loads((checkpoint / "controller.json").read_text())
    assert not any("routed_experts" in s for s in state["samples"]), "a checkpoint holds routed ids, not where they are"
    return {s["routed_at"][0] for s in state["samples"] if "routed_at" in s}


def test_job_sigkill_with_routing_replay_resumes_with_the_routing_the_spool_holds(tmp_path):
    """Routing replay: each finished sample's routed experts are in the run's spool
    (``batches/routed/``), and checkpoints and the journal record where. The whole job is SIGKILLed
    and its newest checkpoint garbled: the resume from the one before reads that checkpoint's samples'
    routing back from the spool (a lost location leaves a sample without routing, which the trainer
    refuses under replay), every step replays, and at the end the spool keeps only segments its last
    checkpoints or their journal tails name (the others were deleted during the run)."""
    from dora_megatron.comm.routed_spool import SPOOL_DIR

    run_dir = tmp_path / "run"
    spool = run_dir / "batches" / SPOOL_DIR
    n = 8
    args = ("run.checkpoint_interval=2", f"run.steps={n}", "algo.routing_replay=true")

    def ready() -> bool:
        if not restorable(run_dir, 4, n):
            return False
        previous = sorted(p for p in (run_dir / "checkpoints").glob("v*") if (p / "controller.json").is_file())[-2]
        return bool(_held_in_spool(previous))

    proc = start_train(run_dir, *args)
    try:
        wait_for(ready, 600, "two checkpoints, the older holding spooled samples, and a journaled sample", proc)
        kill_controller(run_dir, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = sorted(p for p in (run_dir / "checkpoints").glob("v*") if (p / "controller.json").is_file())
    newest, previous = done[-1], done[-2]
    held = _held_in_spool(previous)
    assert held <= {p.name for p in spool.glob("routed_*.bin")}, "the fallback checkpoint's segments were deleted"
    shard = sorted((newest / "trainer").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:  # garbled: the resume falls back to ``previous``
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    out = finish(start_train(run_dir, *args, resume=True))
    assert f"resuming {run_dir} from {previous.name}" in out
    summary, _, _, _ = check_resumed_run(run_dir, n)
    assert summary["routing_replay_steps"] == n
    written = int(max(p.name for p in spool.glob("routed_*.bin"))[7:13]) + 1 if spool.is_dir() else 0
    left = {p.name for p in spool.glob("routed_*.bin")}
    named: set[str] = set()
    for ck in sorted(p for p in (run_dir / "checkpoints").glob("v*") if (p / "controller.json").is_file())[-2:]:
        named |= _held_in_spool(ck) | {j.routed_experts.file for j in read_journal(run_dir, int(ck.name[1:])).values()}
    assert left <= named and len(left) < max(written, 1), (sorted(left), sorted(named), written)


def restorable(run_dir: Path, newest_at_least: int, steps: int) -> bool:
    """The moment to kill for a resume that falls back one checkpoint and has samples to restore: a
    complete checkpoint ``>= newest_at_least``, no newer one being written (its directory is made
    when the trainer starts saving, long before it completes, so the kill right after this check
    lands while these two are the newest), and the journal holding finished samples after the one
    before it. Whether any finish after a cut is the run's scheduling (the rollout may have served
    every admissible group of that version before the cut), so the test waits for a checkpoint
    pair where some did instead of assuming the first one has them. Never at the run's last
    checkpoint (of ``steps``): the job ends right after it, and the kill would race that end."""
    dirs = sorted((run_dir / "checkpoints").glob("v*"))
    done = [p for p in dirs if (p / "controller.json").is_file()]
    newest = int(done[-1].name[1:]) if done else 0
    if len(done) < 2 or not newest_at_least <= newest < steps or dirs[-1] != done[-1]:
        return False
    return bool(read_journal(run_dir, int(done[-2].name[1:])))


def check_prompt_stream(run_dir: Path, lineage: dict[int, list[str]], n: int) -> None:
    """The data position survived the kill: group ``gK`` (the K-th dispatched, counted across the
    crash from the checkpoint) was sent prompt K of the stream, so the resumed run continued with
    the next prompt and no prompt of the final lineage was skipped or served twice."""
    from dora_megatron.config.schema import load_config
    from dora_megatron.data.sources import job_codec, prompt_source

    cfg = load_config(run_dir / "config.yaml")
    source, codec = prompt_source(cfg, job_codec(cfg, None)), job_codec(cfg, None)
    sent: dict[str, list[int]] = {}
    for step in range(n):  # the final lineage's files: a step re-done after the resume replaced its own
        for row in map(json.loads, (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()):
            sent[row["group_id"]] = row["prompt_ids"]
    trained = [g for s in range(n) for g in lineage[s]]
    assert sorted(sent) == sorted(trained)
    for gid in trained:
        k = int(gid[1:])
        assert sent[gid] == codec.encode_prompt(source.get(k)), f"{gid} was not sent prompt {k}"


def test_trainer_rank_sigkill_without_restarts_left_stops_the_job_and_resume_consumes_every_group_once(tmp_path):
    """The trainer rank (torchrun's child, where the step runs) is SIGKILLed with no trainer restart
    allowed (``launch.max_trainer_restarts=0``, as when the budget is spent): the job stops with an
    error naming the trainer and the budget, takes every process with it, and ``--resume`` finishes
    the run from the last checkpoint with each group of the final lineage consumed exactly once."""
    run_dir = tmp_path / "run"
    n = 6
    args = ("run.checkpoint_interval=2", f"run.steps={n}", "launch.max_trainer_restarts=0")
    proc = start_train(run_dir, *args)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "v000002" / "controller.json").is_file() and steps_done(run_dir) >= 3,
                 400, "checkpoint v2 and three steps", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        ranks = [p for p in process_tree(pids["trainer"]) if p != pids["trainer"]]
        assert ranks, "torchrun has no rank process"
        signal_tree(ranks, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, out[-4000:]
        assert "dora train failed" in out and "trainer" in out.split("dora train failed", 1)[1][:400], out[-4000:]
        assert "no trainer restart left (launch.max_trainer_restarts=0, 0 used)" in out, out[-4000:]
        print(out[out.index("dora train failed"):][:400])
        wait_for(lambda: not any(alive(p) for k, p in pids.items() if k != "controller"), 60, "children to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
    crashed_steps = steps_done(run_dir)
    out = finish(start_train(run_dir, *args, resume=True))
    assert "resuming" in out
    print(f"crashed after {crashed_steps} steps;", out[out.index("resuming"):].splitlines()[0])
    assert crashed_steps > 2  # steps after the checkpoint it resumes from were recorded, then re-done
    check_resumed_run(run_dir, n)


def test_trainer_sigkill_during_the_first_checkpoint_and_mid_step_is_restarted_in_the_job(tmp_path):
    """The trainer's rank is SIGKILLed twice in one job: while the first checkpoint is being written
    (nothing complete to go back to: the trainer restarts from the initial weights) and mid-step
    after checkpoint v2 (it restarts from v2). Each time the rollout instances keep running (same
    processes), the job completes with each step in ``consumed.jsonl`` exactly once, and after the
    job no process of any session it started (torchrun's ranks and what they spawned) is left."""
    run_dir = tmp_path / "run"
    n = 5
    proc = start_train(run_dir, "run.checkpoint_interval=2", f"run.steps={n}", "launch.max_trainer_restarts=2",
                       "observability.overview=false")
    seen: set[int] = set()
    try:
        first = run_dir / "checkpoints" / "v000002"
        # the ranks are read once training runs, so the freeze follows the checkpoint directory's
        # appearance within a poll of 10 ms (not a /proc scan later: the write could end meanwhile)
        wait_for(lambda: steps_done(run_dir) >= 1, 400, "the first step", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        ranks = children(pids["trainer"])  # the ranks only: what they started must end with them
        wait_for(first.is_dir, 400, "the first checkpoint write", proc, interval_s=0.01)  # made before the trainer is asked to save
        signal_tree(ranks, signal.SIGSTOP)  # frozen mid-write: the checkpoint cannot complete
        seen |= sessions(process_tree(proc.pid))
        time.sleep(0.5)
        assert not (first / "controller.json").is_file(), "the checkpoint completed before the kill"
        signal_tree(ranks, signal.SIGKILL)
        wait_for(lambda: json.loads((run_dir / "processes.json").read_text())["trainer"] != pids["trainer"], 120,
                 "the trainer restart", proc)
        wait_for(lambda: (first / "controller.json").is_file() and steps_done(run_dir) >= 3, 400,
                 "checkpoint v2 of the restarted lineage and a step after it", proc)
        after = json.loads((run_dir / "processes.json").read_text())
        assert [after[f"engine{i}"] for i in range(2)] == [pids[f"engine{i}"] for i in range(2)]  # kept
        ranks = children(after["trainer"])
        seen |= sessions(process_tree(proc.pid))  # the ranks' spawn child and resource tracker among them
        signal_tree(ranks, signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "restarting it from the initial weights (no complete checkpoint)" in out, out[-4000:]
    assert re.search(r"restarting it from checkpoint v00000[24]", out), out[-4000:]  # v4 if step 3 ended first
    print("\n".join(line for line in out.splitlines() if "trainer lost" in line))
    summary, _, _, _ = check_resumed_run(run_dir, n)
    assert summary["trainer_restarts"] == 2
    final = json.loads((run_dir / "processes.json").read_text())
    assert [final[f"engine{i}"] for i in range(2)] == [pids[f"engine{i}"] for i in range(2)]
    seen.discard(os.getsid(0))
    wait_for(lambda: not in_sessions(seen), 30, "every process of the job's sessions to end")


def test_ctrl_c_checkpoints_at_the_next_step_and_resume_trains_each_group_once(tmp_path):
    """The main job's checkpoint_interval 0: one Ctrl-C while steps run writes a checkpoint at the
    next step boundary and exits 130 (summary.json status "stopped"); ``--resume`` continues from
    it to the end with each group consumed exactly once and nothing trained twice."""
    run_dir = tmp_path / "run"
    n = 5
    proc = start_train(run_dir, f"run.steps={n}", "model.warm_start=")
    try:
        wait_for(lambda: steps_done(run_dir) >= 1, 400, "one step", proc)
        os.kill(proc.pid, signal.SIGINT)
        at_signal = steps_done(run_dir)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    k = summary["stop_checkpoint"]
    assert summary["status"] == "stopped" and summary["stopped_by"] == "SIGINT"
    assert 0 < at_signal <= k < n and summary["steps"] == k == steps_done(run_dir)  # it landed mid-run
    assert f"stopped by SIGINT after {k} step(s): checkpoint v{k:06d} written" in out
    assert (run_dir / "checkpoints" / f"v{k:06d}" / "controller.json").is_file()
    assert "Unclosed" not in out, out[-3000:]  # every HTTP client session was closed on the way out
    out = finish(start_train(run_dir, f"run.steps={n}", "model.warm_start=", resume=True))
    assert f"resuming {run_dir} from v{k:06d}" in out
    check_resumed_run(run_dir, n)


@pytest.mark.parametrize("sigs, status, said", [
    ((signal.SIGTERM, signal.SIGTERM), 143, "terminated (SIGTERM); every process was stopped"),
    ((signal.SIGUSR1,), 138, "stopped by SIGUSR1 after")])
def test_signals_stop_every_process_and_free_the_ports(tmp_path, sigs, status, said):
    """Two SIGTERM (kill, scancel; to the launcher only: the children run in their own process
    groups) end the job at once with status 143; one SIGUSR1 (SLURM's early warning) stops it at
    the next step boundary with a checkpoint (138). Every child, torchrun's ranks included, is
    gone and the ports are free."""
    import socket

    run_dir = tmp_path / "run"
    proc = start_train(run_dir, "run.steps=50", "model.warm_start=")
    try:
        wait_for(lambda: steps_done(run_dir) >= 1, 400, "one step", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        tree = [p for k, v in pids.items() if k != "controller" for p in process_tree(v)]
        ports = [int(m) for log in (run_dir / "logs").glob("*.log")
                 for m in re.findall(r"listening on http://[0-9.]+:(\d+)", log.read_text(errors="replace"))]
        for sig in sigs:
            os.kill(proc.pid, sig)
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, out[-3000:]
    assert said in out
    assert "Unclosed" not in out, out[-3000:]  # the HTTP client sessions were closed on the way out
    if len(sigs) == 1:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "stopped" and summary["steps"] < 50
        assert (run_dir / "checkpoints" / f"v{summary['stop_checkpoint']:06d}" / "controller.json").is_file()
    assert not any(alive(p) for p in tree), [p for p in tree if alive(p)]
    assert len(ports) >= 2, ports  # both engines (and the trainer, if it logs its address)
    for port in ports:  # free again: a new server can bind it
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_engine_sigkill_during_startup_is_restarted_and_the_job_completes(tmp_path):
    """An engine SIGKILLed after it started but before the first step (during the launcher's wait
    for the instances): the job does not end; the engine is restarted under the restart budget and
    serves, and every group is consumed exactly once."""
    run_dir = tmp_path / "run"
    n = 2
    proc = start_train(run_dir, f"run.steps={n}", "run.checkpoint_interval=0", "rollout.max_new_tokens=24",
                       "observability.tensorboard=false", "observability.overview=false")
    try:
        wait_for(lambda: (run_dir / "processes.json").is_file(), 300, "the engines to start", proc)
        pids = json.loads((run_dir / "processes.json").read_text())
        killed_before_first_step = not (run_dir / "steps.jsonl").exists()  # opened once the wait is over
        os.kill(pids["engine0"], signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_before_first_step
    assert "engine0 failed while the job starts (exited with status -9" in out, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == n and summary["consumed_groups"] == n * 4
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    groups = [g for line in (run_dir / "consumed.jsonl").read_text().splitlines() for g in json.loads(line)["groups"]]
    assert len(groups) == len(set(groups)) == n * 4
    assert summary["engine_restarts"] >= 1
    assert "restarted by the launcher" in (run_dir / "logs" / "engine0.log").read_text()
    # the restarted engine is in the pool: from the start, or it joined once ready
    assert "engine0" in summary["instances"]
    assert "engine0" not in summary["instances_absent_at_start"] or summary["instances_rejoined"] == 1
