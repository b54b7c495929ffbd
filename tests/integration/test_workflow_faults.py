"""A whole job running a two-turn workflow (a tool between the turns) is SIGKILLed while
trajectories are between their turns, then resumed: every group of the final lineage is trained
exactly once, and the trajectories the kill cut ran again from their prompts."""

from __future__ import annotations

import pytest

from tests.helpers.fault_jobs import (ROOT, check_resumed_run, finish, kill_controller, start_train, steps_done,
                                      wait_for)

pytestmark = pytest.mark.integration


def _notes(log) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.is_file() else []


def _between_turns(notes) -> set[str]:
    """Samples whose first turn returned and whose trajectory did not complete."""
    return {sid for what, sid in notes if what == "turn"} - {sid for what, sid in notes if what == "done"}


def test_job_sigkill_between_turns_then_resume_trains_every_group_once(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "turns.log"
    n = 6
    args = ("run.checkpoint_interval=2", f"run.steps={n}",
            f"rollout.workflow={ROOT / 'tests' / 'helpers' / 'workflows.py'}:two_turns_with_tool",
            f'rollout.workflow_kwargs={{tool_s: 0.2, log: "{log}"}}')
    proc = start_train(run_dir, *args)
    try:
        checkpoint = run_dir / "checkpoints" / "v000002" / "controller.json"
        wait_for(lambda: checkpoint.is_file() and steps_done(run_dir) >= 3 and _between_turns(_notes(log)), 400,
                 "checkpoint v2, three steps and a trajectory between turns", proc)
        kill_controller(run_dir, proc)  # the whole job, while trajectories are between turns
    finally:
        if proc.poll() is None:
            proc.kill()
    crashed = _notes(log)
    cut = _between_turns(crashed)
    assert cut, "the kill landed between no trajectory's turns"
    resumed = start_train(run_dir, *args, resume=True)
    finish(resumed)
    summary, records, lineage, _ = check_resumed_run(run_dir, n)
    assert summary["env/trajectories"] > 0 and summary["env/turns"] == 2 * summary["env/trajectories"]
    assert "workflow_turn_moves" in summary
    trained = {g for groups in lineage.values() for g in groups}
    after = _notes(log)[len(crashed):]
    rerun = {sid for sid in cut if sid.rsplit(".", 1)[0] in trained}
    assert rerun, "no trajectory cut by the kill belongs to a trained group"
    for sid in rerun:  # each ran again from its first turn after the resume, and completed
        assert ("turn", sid) in after and ("done", sid) in after
