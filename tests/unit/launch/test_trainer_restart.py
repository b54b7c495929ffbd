"""The in-job trainer restart rule (:mod:`dora_megatron.launch.trainer_restart`) with fakes: the
restart budget, the checkpoint a restart starts from, the watchdog, the trainer's command line,
the reset of kept instances, and the supervisor naming a dead trainer process as lost."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from dora_megatron.launch.trainer_restart import (TrainerLost, TrainerRestarts, reset_engines, restart_point,
                                                  run_restarting, trainer_argv, watch_trainer)
from dora_megatron.processes import ChildFailed


class FakeJob:
    """A controller run against a fake trainer that dies ``deaths`` times: each run trains from
    the checkpoint it is given, records what it was started from, and the restart hands back the
    checkpoint of the version the lost lineage last completed."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.started_from: list[Path | None] = []
        self.restarted_after: list[str] = []

    def run_once(self, checkpoint: Path | None) -> dict:
        self.started_from.append(checkpoint)
        if len(self.started_from) <= self.deaths:
            raise TrainerLost(f"trainer exited with status -9 (death {len(self.started_from)})\nlast log lines:\n...")
        return {"status": "completed"}

    def restart(self, err: TrainerLost) -> Path | None:
        self.restarted_after.append(str(err).splitlines()[0])
        return Path(f"checkpoints/v{2 * len(self.restarted_after):06d}")


def test_a_lost_trainer_is_restarted_from_the_checkpoint_the_restart_chose_until_the_run_ends():
    job, budget = FakeJob(deaths=2), TrainerRestarts(max_restarts=2)
    assert run_restarting(job.run_once, job.restart, None, budget) == {"status": "completed"}
    assert job.started_from == [None, Path("checkpoints/v000002"), Path("checkpoints/v000004")]
    assert job.restarted_after == ["trainer exited with status -9 (death 1)", "trainer exited with status -9 (death 2)"]
    assert budget.used == 2 and budget.reasons == job.restarted_after


def test_when_the_budget_is_spent_the_job_fails_naming_the_cause_and_the_key():
    job, budget = FakeJob(deaths=3), TrainerRestarts(max_restarts=1)
    with pytest.raises(TrainerLost) as info:
        run_restarting(job.run_once, job.restart, Path("checkpoints/v000002"), budget)
    head = str(info.value).splitlines()[0]
    assert head == ("trainer exited with status -9 (death 2); no trainer restart left "
                    "(launch.max_trainer_restarts=1, 1 used)")
    assert "last log lines:" in str(info.value)  # the trainer's own story is kept
    assert len(job.started_from) == 2  # the first run and the one restart, no third


def test_zero_restarts_fails_at_the_first_loss_and_other_errors_use_no_restart():
    job = FakeJob(deaths=1)
    with pytest.raises(TrainerLost, match="max_trainer_restarts=0"):
        run_restarting(job.run_once, job.restart, None, TrainerRestarts(0))
    assert job.restarted_after == []

    def answered_error(_):  # a trainer that answered an error lives on: a restart would repeat it
        raise ChildFailed("trainer /train: HTTP 500: ValueError: bad batch")

    budget = TrainerRestarts(3)
    with pytest.raises(ChildFailed, match="HTTP 500") as info:
        run_restarting(answered_error, job.restart, None, budget)
    assert not isinstance(info.value, TrainerLost) and budget.used == 0


def _checkpoint(run_dir: Path, version: int, complete: bool) -> Path:
    ck = run_dir / "checkpoints" / f"v{version:06d}"
    (ck / "trainer").mkdir(parents=True)
    (ck / "trainer" / "shard.bin").write_bytes(b"x" * 8)
    (run_dir / "weights" / f"v{version:06d}").mkdir(parents=True, exist_ok=True)
    if complete:  # as the runtime completes one: the manifest, then controller.json
        from dora_megatron.controller.checkpoint_manifest import describe_files, describe_tree, write_manifest

        state = ck / "controller.json"
        state.write_text(json.dumps({"version": version, "groups": [], "orchestrator": {"groups": []}}))
        write_manifest(ck, {**describe_tree(ck, "trainer"), **describe_files(ck, [state])})
    return ck


def test_the_restart_point_skips_the_checkpoint_being_written_when_the_trainer_died(tmp_path):
    assert restart_point(tmp_path, print) is None  # the first checkpoint was never completed: initial weights
    _checkpoint(tmp_path, 4, complete=False)
    assert restart_point(tmp_path, print) is None
    good = _checkpoint(tmp_path, 2, complete=True)
    assert restart_point(tmp_path, print) == good


def test_the_trainer_argv_loads_the_restart_point_instead_of_what_it_loaded_before():
    base = ["python", "-m", "torch.distributed.run", "-m", "dora_megatron.trainer.service", "--port", "9"]
    resumed = trainer_argv(base + ["--resume", "/r/checkpoints/v000002/trainer"], Path("/r/checkpoints/v000004"))
    assert resumed == base + ["--resume", "/r/checkpoints/v000004/trainer"]
    assert trainer_argv(resumed, None) == base


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0


def test_the_watchdog_reports_a_silent_trainer_once_and_not_a_busy_one():
    clock = FakeClock()
    answers = iter([{"ready": True}] * 5 + [None] * 50)  # busy but answering, then silent

    async def health():
        clock.t += 1.0  # each poll is one second of the fake clock
        return next(answers)

    lost: list[TrainerLost] = []
    asyncio.run(asyncio.wait_for(watch_trainer(health, 10.0, lost.append, poll_s=0, clock=lambda: clock.t), 5))
    assert len(lost) == 1
    assert clock.t == 15.0  # 5 answers, then 10 s of silence, not sooner
    assert "did not answer /health for 10 s (controller.trainer_timeout_s=10)" in str(lost[0])


class FakeEngine:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.loaded: list[tuple[str, int]] = []

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        if self.fails:
            raise ConnectionError("refused")
        self.loaded.append((path, weight_version))


def test_kept_instances_reload_the_initial_weights_and_unreachable_ones_are_named(tmp_path):
    engines = {"engine0": FakeEngine(), "engine1": FakeEngine(fails=True), "engine2": FakeEngine()}
    assert asyncio.run(reset_engines(engines, tmp_path / "model")) == ["engine1"]
    assert engines["engine0"].loaded == engines["engine2"].loaded == [(str(tmp_path / "model"), 0)]


def test_the_supervisor_reports_a_dead_trainer_process_as_lost(tmp_path):
    from dora_megatron.launch.supervise import EngineSupervisor, RestartPolicy
    from dora_megatron.processes import ProcessSet

    from tests.helpers.fakes import FakeRuntime

    with ProcessSet(tmp_path) as procs:
        child = procs.start("trainer", [sys.executable, "-c", "print('rank 0: killed', flush=True); raise SystemExit(9)"])
        child.popen.wait(timeout=30)
        rt = FakeRuntime([])
        EngineSupervisor(procs, rt, RestartPolicy(enabled=False), lambda url: url, []).check()
    assert isinstance(rt.tasks.error, TrainerLost) and rt.tasks.is_done()
    assert str(rt.tasks.error).startswith("trainer exited with status 9")


# A rank in miniature: ties itself to its parent, starts a ``multiprocessing`` spawn child (which
# ties itself too when it imports the main module, as ``dora_megatron.trainer.service`` does) and a
# fork child, prints their pids and the resource tracker's, then waits to be killed. The kill comes
# at once, mostly before the spawn child has tied itself: it must then notice its parent is gone.
RANK = '''
import multiprocessing as mp, os, sys, time
from dora_megatron.processes import PARENT_PID_ENV, end_with_parent

def wait():
    time.sleep(120)

if __name__ == "__mp_main__":
    end_with_parent(parent=int(os.environ[PARENT_PID_ENV]))
if __name__ == "__main__":
    end_with_parent()
    spawned = mp.get_context("spawn").Process(target=wait)
    spawned.start()
    forked = mp.get_context("fork").Process(target=wait)
    forked.start()
    from multiprocessing import resource_tracker
    print(spawned.pid, forked.pid, resource_tracker._resource_tracker._pid, flush=True)
    time.sleep(120)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_what_a_killed_rank_started_ends_with_it(tmp_path):
    """SIGKILL of the rank (nothing else is signalled): its spawn child and fork child get their
    parent-death signal and the resource tracker exits once no process holds it. Without
    ``end_with_parent`` all three are left under init."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "rank.py"
    script.write_text(RANK)
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        spawned, forked, tracker = (int(x) for x in rank.stdout.readline().split())
        assert all(_alive(p) for p in (spawned, forked, tracker))
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in (spawned, forked, tracker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in (spawned, forked, tracker) if _alive(p)] == []
    finally:
        try:
            os.killpg(rank.pid, signal.SIGKILL)  # the test's own cleanup if it failed
        except ProcessLookupError:
            pass
