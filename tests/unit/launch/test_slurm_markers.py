"""End markers of SLURM jobs and the wait of the non-controller nodes: every end leaves a marker that
names its job, a resumed job is not stopped by the marker of the job it resumes, a signal writes
FAILED before anything stops, and a dead rollout instance is restarted instead of ending the node."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.launch.cluster import slurm_plan
from dora_megatron.launch.elastic import read_join_requests
from dora_megatron.processes import ProcessSet
from dora_megatron.launch.slurm import read_slurm_env
from dora_megatron.launch.slurm_run import (DONE, FAILED, NodeEngines, _clear_previous_markers, _EndSignals,
                                            _serve_until_end, read_marker, write_marker)
from dora_megatron.launch.stop import Stopped
from tests.helpers.servers import hold_port

ROOT = Path(__file__).resolve().parents[3]


def test_first_marker_of_a_job_wins_and_names_the_job(tmp_path):
    assert write_marker(tmp_path, FAILED, "terminated by SIGTERM on n2 (scancel or time limit)", "41")
    assert not write_marker(tmp_path, DONE, "ok", "41")  # the job already ended: the first reason stays
    m = read_marker(tmp_path)
    assert (m.kind, m.reason, m.job_id) == (FAILED, "terminated by SIGTERM on n2 (scancel or time limit)", "41")
    _clear_previous_markers(tmp_path, "42")  # job 42 resumes the run
    assert read_marker(tmp_path) is None and (tmp_path / "FAILED.job41").is_file()
    assert write_marker(tmp_path, DONE, "ok", "42") and read_marker(tmp_path).job_id == "42"


def test_a_finished_run_extended_by_a_new_job_gets_that_jobs_marker(tmp_path):
    """``sbatch ... --resume RUN_DIR --set run.steps=N`` of a run that ended DONE: the old DONE is set
    aside, so the new job can write its own (before, os.link failed and the other nodes waited on)."""
    assert write_marker(tmp_path, DONE, "ok", "41")
    _clear_previous_markers(tmp_path, "42")
    assert read_marker(tmp_path) is None and (tmp_path / "DONE.job41").is_file()
    assert write_marker(tmp_path, DONE, "ok", "42") and read_marker(tmp_path).job_id == "42"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_sigterm_and_sigint_write_failed_before_unwinding(tmp_path, sig):
    """Before the controller's runtime runs (nothing to checkpoint) a signal ends the node at once."""
    before = signal.getsignal(sig)
    with pytest.raises(Stopped):
        with _EndSignals(tmp_path, "7", "n1"):
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler interrupts this
    m = read_marker(tmp_path)
    assert m.kind == FAILED and f"{sig.name} on n1" in m.reason and m.job_id == "7"
    assert signal.getsignal(sig) is before  # restored


def test_a_joining_node_ending_does_not_mark_the_run(tmp_path):
    with pytest.raises(Stopped):
        with _EndSignals(tmp_path, "8", "n2", mark=False):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert read_marker(tmp_path) is None


def _node(tmp_path: Path, overrides=()):
    """Node n2 of a 3-node CPU job whose single engine is a stand-in HTTP server (python -m http.server)."""
    cfg = load_config(ROOT / "configs" / "cpu_slurm.yaml", ["rollout.startup_timeout_s=30", *overrides])
    plan = slurm_plan(cfg, read_slurm_env({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "5"}), "/m", str(tmp_path))
    return cfg, plan


class _StandIn:
    """What matters here is the process and its /health; a tiny HTTP server on a free loopback port."""

    def __init__(self, procs: ProcessSet, name: str, root: Path) -> None:
        from dora_megatron.ports import free_port

        (root / "health").write_text("ok")  # GET /health answers 200 with this file
        self.port = free_port()
        self.argv = [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1", "--directory", str(root)]
        self.child = procs.start(name, self.argv)


def test_dead_instance_is_restarted_and_asks_to_rejoin_and_the_node_stays_up(tmp_path):
    """Before: a dead instance on a non-controller node made that node exit 1 (ProcessSet.check_alive),
    and srun --kill-on-bad-exit then ended the whole job."""
    import dataclasses

    cfg, plan = _node(tmp_path)
    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        inst = _StandIn(procs, "engine0", tmp_path)
        url = f"http://127.0.0.1:{inst.port}"
        plan = dataclasses.replace(plan, engine_urls={**plan.engine_urls, "engine0": url})
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False)
        assert engines.names == {"engine0"}
        inst.child.popen.kill()
        inst.child.popen.wait()
        deadline = time.monotonic() + 60
        while not read_join_requests(tmp_path / "join") and time.monotonic() < deadline:
            engines.check()  # raises ChildFailed in the old behaviour
            time.sleep(0.2)
        reqs = read_join_requests(tmp_path / "join")
        assert [(r.name, r.url, r.attempt) for r in reqs] == [("engine0", url, 1)]
        assert procs.children[0].alive() and procs.children[0].popen.pid != inst.child.popen.pid
        # a marker of another job (the one this run resumes) does not end the wait; this job's does
        write_marker(tmp_path, FAILED, "terminated by SIGTERM on n1", "4")
        later = threading.Timer(1.0, lambda: (os.replace(tmp_path / FAILED, tmp_path / "FAILED.job4"),
                                              write_marker(tmp_path, DONE, "ok", "5")))
        later.start()
        try:
            t0 = time.monotonic()
            assert _serve_until_end(tmp_path, engines, "5", poll_s=0.1) == 0
            assert time.monotonic() - t0 >= 0.9
        finally:
            later.join()


def test_instance_without_restarts_left_is_given_up_and_the_node_stays_up(tmp_path):
    cfg, plan = _node(tmp_path, ["launch.max_engine_restarts=0"])
    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        inst = _StandIn(procs, "engine0", tmp_path)
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False)
        inst.child.popen.kill()
        inst.child.popen.wait()
        engines.check()
        assert engines.given_up == {"engine0"} and not read_join_requests(tmp_path / "join")
        write_marker(tmp_path, DONE, "ok", "5")
        assert _serve_until_end(tmp_path, engines, "5", poll_s=0.1) == 0


def test_a_trainer_rank_node_fails_only_on_a_non_zero_exit(tmp_path):
    """Nodes 2.. of a multi-node trainer: torchrun exits 0 when the controller shuts the trainer down
    at the end (DONE follows); any other exit ends the run."""
    from dora_megatron.processes import ChildFailed

    cfg, plan = _node(tmp_path)
    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        procs.start("trainer1", [sys.executable, "-c", "pass"]).popen.wait()
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False)
        engines.check()  # exit 0: not a failure
        procs.start("trainer2", [sys.executable, "-c", "raise SystemExit(3)"]).popen.wait()
        with pytest.raises(ChildFailed, match="trainer2 exited with status 3"):
            engines.check()


def test_joiner_refuses_a_run_that_has_ended_at_once(tmp_path):
    """A joiner pointed at a finished run (DONE, no live heartbeat) exits 1 naming the marker, before
    starting anything (before: it waited for the end of a run that had already ended, i.e. forever)."""
    import subprocess

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((ROOT / "configs" / "cpu_slurm.yaml").read_text())
    write_marker(run_dir, DONE, "ok", "3")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dora_megatron", "train", "--config", str(ROOT / "configs" / "cpu_slurm.yaml"),
                           "--join", "--set", f"run.run_dir={run_dir}", "--slurm-env", "SLURM_JOB_NODELIST=n2",
                           "--slurm-env", "SLURM_NODEID=0", "--slurm-env", "SLURM_JOB_ID=4"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "has ended (DONE: ok)" in proc.stderr and time.monotonic() - t0 < 60
    assert not (run_dir / "logs").exists()  # nothing was started


def test_a_trainer_node_restarts_its_part_when_the_controller_asks_and_waits_for_that_request(tmp_path):
    """Node n2 of a trainer spanning n1-n2: its torchrun died (the whole trainer is lost). With
    trainer restarts left the node neither fails nor restarts it on its own: it waits for the
    controller's request (the controller chose the checkpoint); it then restarts its torchrun from
    that checkpoint, once per request; a request of another job (the one this job resumes) is
    ignored. With the budget used up, the next death fails the node as before."""
    from dora_megatron.launch.trainer_restart import RestartRequest, parts_lost, request_restart
    from dora_megatron.processes import ChildFailed

    cfg, plan = _node(tmp_path, ["cluster.trainer_nodes=2", "launch.max_trainer_restarts=1"])
    (spec,) = [p for p in plan.processes_on("n2") if p.role == "trainer"]
    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        # the planned argv's stand-in: records its own argv, then lives (a trainer) or dies (status 9)
        script = "import sys, json, time; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n'); " \
                 "time.sleep(600) if '--resume' in sys.argv else sys.exit(9)"
        argv = [sys.executable, "-c", script, str(tmp_path / "argv.jsonl"), "--run-dir", str(tmp_path)]
        first = procs.start(spec.name, argv)
        first.popen.wait()
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False,
                              run_dir=tmp_path, job_id="5")
        engines.check()  # dead, no request yet: it waits (before: ChildFailed, the job ended)
        engines.check()
        # and tells the controller, once, for the lineage it runs (no restart carried out yet)
        (notice,) = parts_lost(tmp_path, "5", 0)
        assert (notice.node, notice.reason) == ("n2", f"{spec.name} exited with status 9")
        assert len(list(tmp_path.glob("trainer_lost.*.json"))) == 1
        request_restart(tmp_path, RestartRequest("4", 1, tmp_path / "checkpoints" / "v000009"))  # the resumed job's
        engines.check()
        assert procs.children[0].popen.pid == first.popen.pid
        request_restart(tmp_path, RestartRequest("5", 1, tmp_path / "checkpoints" / "v000002"))
        engines.check()
        engines.check()  # one restart per request
        restarted = procs.children[0]
        assert restarted.popen.pid != first.popen.pid and restarted.alive()
        lines = _wait_lines(tmp_path / "argv.jsonl", 2)
        assert lines[1] == ["--run-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoints" / "v000002" / "trainer")]
        restarted.popen.kill()
        restarted.popen.wait()
        with pytest.raises(ChildFailed, match=f"{spec.name} exited with status -9"):
            engines.check()  # no restart left


def test_the_controller_counts_the_trainer_lost_on_a_notice_of_its_current_lineage_only(tmp_path):
    """A trainer node's notice that its part died (the ranks left wait for it in a collective while
    rank 0 answers /health: before, the job hung until the process group's timeout) ends the
    controller's run with TrainerLost naming the node; a notice written before the last restart
    (an older lineage) or by the job this one resumes is not acted on."""
    import asyncio

    from dora_megatron.launch.trainer_restart import PartLost, TrainerLost, report_part_lost, watch_trainer_parts

    report_part_lost(tmp_path, PartLost("4", 0, "n3", "trainer2 exited with status 1"))  # the resumed job's
    report_part_lost(tmp_path, PartLost("5", 0, "n2", "trainer1 exited with status -9"))  # before restart 1
    lost: list[TrainerLost] = []

    async def watch_until_ended(lineage: int) -> bool:
        """Whether the watch of ``lineage`` ended the run, after its first poll."""
        task = asyncio.ensure_future(watch_trainer_parts(tmp_path, "5", lineage, lost.append, poll_s=0.01))
        await asyncio.sleep(0)  # one poll: the notices are on disk already
        ended = task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ended

    assert not asyncio.run(watch_until_ended(1)) and lost == []  # stale after restart 1
    report_part_lost(tmp_path, PartLost("5", 1, "n2", "trainer1 exited with status 1"))
    assert asyncio.run(watch_until_ended(1))
    assert [str(e) for e in lost] == ["the trainer's part on n2 died: trainer1 exited with status 1"]
    assert isinstance(lost[0], TrainerLost)


def test_an_error_answered_by_a_trainer_spanning_nodes_is_a_lost_trainer_once_its_other_node_reports(tmp_path):
    """Rank 0 of a trainer over n1-n2 whose rank on n2 died may fail the step's collective and answer
    HTTP 500 ("Connection closed by peer") while it lives on; before, that answer failed the job (a
    plain ChildFailed, as an error a restart would repeat). The notice n2 writes after it (within
    its poll period) makes it a TrainerLost, restarted; for a trainer on the controller's node only,
    the answered error stays a ChildFailed."""
    import asyncio

    from dora_megatron.launch.slurm_run import JoiningLauncher
    from dora_megatron.launch.trainer_restart import PartLost, TrainerLost, report_part_lost
    from dora_megatron.processes import ChildFailed

    cfg, _ = _node(tmp_path, ["cluster.trainer_nodes=2"])
    answered = "trainer /train: HTTP 500: RuntimeError: Connection closed by peer [127.0.0.2]:2218"

    def launcher(procs, lineage):
        return JoiningLauncher(cfg, procs, tmp_path, tmp_path / "model", "n1", tmp_path / "join", trainer_lineage=lineage)

    async def answered_then_reported(spanning) -> BaseException:
        async def report_later() -> None:
            await asyncio.sleep(0.3)  # the answer comes first
            report_part_lost(tmp_path, PartLost("5", 0, "n2", "trainer1 exited with status 1"))

        _, err = await asyncio.gather(report_later(), spanning.trainer_failure(RuntimeError("HTTP 500"), answered))
        return err

    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:  # no local trainer child to wait for here
        err = asyncio.run(answered_then_reported(launcher(procs, ("5", 0))))
        assert isinstance(err, TrainerLost) and str(err) == "the trainer's part on n2 died: trainer1 exited with status 1"
        err = asyncio.run(launcher(procs, None).trainer_failure(RuntimeError("HTTP 500"), answered))
        assert type(err) is ChildFailed and str(err) == answered


def _wait_lines(path: Path, n: int, timeout_s: float = 30.0) -> list:
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} lines after {timeout_s} s")


@pytest.mark.parametrize("trainer_nodes", [1, 2])
def test_the_controller_restarts_its_torchrun_and_asks_other_trainer_nodes_for_the_same_checkpoint(tmp_path,
                                                                                                 trainer_nodes):
    """The controller's node (n1) after a trainer loss with no complete checkpoint: its own torchrun
    is restarted from the initial weights; a request naming the same start point (and the restart's
    number) is written only when the trainer has a part on another node."""
    import dataclasses

    from dora_megatron.launch.slurm_run import _restart_trainer
    from dora_megatron.launch.trainer_restart import (RESTART_REQUEST, RestartRequest, TrainerLost, TrainerRestarts,
                                                      restart_requested)

    cfg, plan = _node(tmp_path, [f"cluster.trainer_nodes={trainer_nodes}"])
    plan = dataclasses.replace(plan, engine_urls={})  # no instance to reload here
    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        old = procs.start("trainer", [sys.executable, "-c", "import time; time.sleep(600)"])
        budget = TrainerRestarts(2)
        lost = TrainerLost("trainer exited with status -9")
        assert budget.take(lost)
        assert _restart_trainer(cfg, plan, procs, tmp_path, tmp_path / "model", lost, budget, "5") is None
        assert not old.alive() and procs.children[0].alive() and procs.children[0].popen.pid != old.popen.pid
    if trainer_nodes == 1:
        assert not (tmp_path / RESTART_REQUEST).exists()
    else:
        assert restart_requested(tmp_path, "5", 0) == RestartRequest("5", 1, None)
        assert restart_requested(tmp_path, "5", 1) is None


def test_an_instance_whose_port_another_process_took_is_reported_with_the_holder_and_restarts_on_another_port(tmp_path,
                                                                                                            capsys):
    """The node picks engine0's port and publishes it; another process (a second job's engine, a
    slurmd) binds it before engine0 does, so engine0 exits with EADDRINUSE. The node says which port
    on which node and which pid holds it (published for the controller too), picks another port of
    launch.port_range for the restart, publishes it and asks to rejoin at the new URL."""
    import dataclasses

    from dora_megatron.launch.addresses import PortPicker, read as read_address
    from dora_megatron.ports import job_port_range, pick_ports

    lo, hi = job_port_range()
    base = pick_ports(1, "0.0.0.0", (lo, hi - 3))[0]
    window = (base, base + 3)
    cfg, plan = _node(tmp_path, [f"launch.port_range=[{window[0]},{window[1]}]"])
    (tmp_path / "health").write_text("ok")
    stand_in = (sys.executable, "-m", "http.server", "{port:engine0}", "--bind", "127.0.0.1", "--directory", str(tmp_path))
    spec = next(p for p in plan.processes if p.name == "engine0")
    assert spec.host == "n2" and spec.auto_ports == ("engine0",) and "{port:engine0}" in spec.argv
    plan = dataclasses.replace(plan, engine_urls={**plan.engine_urls, "engine0": "http://127.0.0.1:{port:engine0}"},
                               processes=[dataclasses.replace(p, argv=stand_in) if p is spec else p for p in plan.processes])
    picker = PortPicker(tmp_path, "5", "n2", job_port_range(cfg.launch.port_range), wait_s=5)
    argv, picked = picker.resolve(stand_in, ("engine0",))
    taken = picked["engine0"]
    assert window[0] <= taken <= window[1] and read_address(tmp_path, "engine0", "5").port == taken
    with hold_port(taken) as holder, ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        first = procs.start("engine0", argv)
        assert first.popen.wait(timeout=30) != 0  # the collision happened: it could not bind
        assert "Address already in use" in first.log_path.read_text()
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False, run_dir=tmp_path,
                              job_id="5", picker=picker)
        deadline = time.monotonic() + 60
        while not read_join_requests(tmp_path / "join") and time.monotonic() < deadline:
            engines.check()
            time.sleep(0.2)
        (req,) = read_join_requests(tmp_path / "join")
        now = read_address(tmp_path, "engine0", "5")
        assert now.port != taken and window[0] <= now.port <= window[1] and not now.failed
        assert (req.name, req.url, req.attempt) == ("engine0", f"http://127.0.0.1:{now.port}", 1)
    said = capsys.readouterr().err  # the node's report names the port, the node and the holder
    assert f"engine0 on n2 exited with status 1: engine0 cannot bind port {taken} on node n2" in said
    assert f"held by pid {holder.pid} (" in said and f"restarting it (attempt 1 of 3) at http://127.0.0.1:{now.port}" in said


def test_a_node_publishes_why_its_instance_failed_naming_the_port_and_its_holder(tmp_path, capsys):
    """No restart left: the failure record the controller reads names the port, the node and the holder's pid."""
    import dataclasses

    from dora_megatron.launch.addresses import PortPicker, read as read_address
    from dora_megatron.ports import job_port_range

    cfg, plan = _node(tmp_path, ["launch.max_engine_restarts=0"])
    stand_in = (sys.executable, "-m", "http.server", "{port:engine0}", "--bind", "127.0.0.1", "--directory", str(tmp_path))
    plan = dataclasses.replace(plan, processes=[dataclasses.replace(p, argv=stand_in) if p.name == "engine0" else p
                                                for p in plan.processes])
    picker = PortPicker(tmp_path, "5", "n2", job_port_range(), wait_s=5)
    argv, picked = picker.resolve(stand_in, ("engine0",))
    port = picked["engine0"]
    with hold_port(port) as holder, ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        assert procs.start("engine0", argv).popen.wait(timeout=30) != 0  # it could not bind
        engines = NodeEngines(cfg, procs, plan, "n2", tmp_path / "join", announce_first=False, run_dir=tmp_path,
                              job_id="5", picker=picker)
        engines.check()
        rec = read_address(tmp_path, "engine0", "5")
        assert rec.final and rec.port == port
        assert f"engine0 cannot bind port {port} on node n2" in rec.failed and f"pid {holder.pid} (" in rec.failed
    assert "no restart left" in capsys.readouterr().err and engines.given_up == {"engine0"}
