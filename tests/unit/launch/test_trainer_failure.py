"""How the launcher names a trainer that stopped answering: its exit status and log tail when the
process died (as after a killed rank), else the connection error after a bounded wait."""

from __future__ import annotations

import asyncio
import sys
import time

from dora_megatron.launch.process_launcher import trainer_failure
from dora_megatron.launch.trainer_restart import TrainerLost
from dora_megatron.processes import ProcessSet


def test_dead_trainer_is_named_with_its_status_and_log(tmp_path):
    script = "import sys, time; print('rank 0 lost', flush=True); time.sleep(0.5); sys.exit(7)"
    with ProcessSet(tmp_path) as procs:
        procs.start("trainer", [sys.executable, "-c", script])
        err = asyncio.run(trainer_failure(procs, ConnectionError("refused"), wait_s=30))
    assert "trainer exited with status 7" in str(err) and "rank 0 lost" in str(err)
    assert isinstance(err, TrainerLost)  # dead: the job may restart it


def test_live_but_silent_trainer_reports_the_connection_error_after_the_wait(tmp_path):
    with ProcessSet(tmp_path) as procs:
        procs.start("trainer", [sys.executable, "-c", "import time; time.sleep(60)"])
        t0 = time.monotonic()
        err = asyncio.run(trainer_failure(procs, ConnectionError("refused"), wait_s=0.5))
        assert 0.4 < time.monotonic() - t0 < 10
    assert str(err) == "the trainer stopped answering (refused)" and isinstance(err, TrainerLost)


def test_remote_trainer_without_a_local_process(tmp_path):
    with ProcessSet(tmp_path) as procs:
        err = asyncio.run(trainer_failure(procs, ConnectionError("reset"), wait_s=5))
    assert str(err) == "the trainer stopped answering (reset)"


def test_a_failed_torchrun_child_is_named_by_its_own_error_not_the_launcher_banner(tmp_path):
    """torchrun ends a failed rank's log with its ``ChildFailedError`` banner; the reason is the
    rank's own exception line above it, which must lead the message."""
    from dora_megatron.processes import ChildFailed

    script = tmp_path / "rank.py"
    script.write_text("raise ValueError('ep=2 needs an MoE model with experts divisible by ep')\n")
    with ProcessSet(tmp_path / "logs") as procs:
        child = procs.start("trainer", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                                        "--master_port=0", str(script)])
        child.popen.wait(timeout=120)
        try:
            procs.check_alive()
        except ChildFailed as err:
            message = str(err)
        else:
            raise AssertionError("a dead child was not reported")
    assert "ChildFailedError" in child.tail(60)  # the banner is there, and is not what we report first
    assert message.splitlines()[0] == ("trainer exited with status 1: "
                                       "ValueError: ep=2 needs an MoE model with experts divisible by ep"), message


def test_a_trainer_that_answered_an_error_and_lives_on_is_not_lost(tmp_path):
    """An error answer (HTTP 500) from a live trainer ends the job as before: a restart would
    only repeat it."""
    with ProcessSet(tmp_path) as procs:
        procs.start("trainer", [sys.executable, "-c", "import time; time.sleep(60)"])
        err = asyncio.run(trainer_failure(procs, RuntimeError("HTTP 500"), wait_s=0.3, answered="trainer /train: HTTP 500"))
    assert str(err) == "trainer /train: HTTP 500" and not isinstance(err, TrainerLost)


def test_children_and_their_own_children_ignore_the_jobs_early_warning(tmp_path):
    """SLURM passes the time limit's warning (SIGUSR1) to every process of the job step: a trainer
    that died of it (default action) could not write the checkpoint the warning asks for."""
    import os
    import signal
    import subprocess

    import pytest

    script = ("import subprocess, sys, time\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(g.pid, flush=True); time.sleep(60)")
    with ProcessSet(tmp_path) as procs:
        child = procs.start("trainer", [sys.executable, "-c", script])
        deadline = time.monotonic() + 30
        while not child.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [child.popen.pid, int(child.log_path.read_text().split()[0])]
        ignored = [int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("SigIgn:")).split()[1], 16)
                   & (1 << (signal.SIGUSR1 - 1)) for pid in pids]
        os.kill(pids[0], signal.SIGUSR1)
        with pytest.raises(subprocess.TimeoutExpired):
            child.popen.wait(timeout=1)  # still running after the warning
        os.kill(pids[1], signal.SIGKILL)
    assert all(ignored), ignored
