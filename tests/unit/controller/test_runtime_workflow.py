"""The runtime with a rollout workflow (``rollout.workflow``) on fake engines: each trajectory's
turns run on one instance with one version, the trainer gets the loss mask, the reward sees the
model's tokens only, and interrupts, failed instances, crashed environments and a resume lose and
duplicate nothing."""

from __future__ import annotations

import asyncio
import itertools

from dora_megatron.controller.main import drive
from tests.helpers.runtime import check_run, engine_versions, make, resume, run_killing, trained_groups
from tests.helpers.runtime_workflow import ENV, answer_then_env, check_trajectories, make_with_workflow


def test_dora_runs_each_trajectory_on_one_version_and_hands_the_trainer_its_mask():
    rt, engines, trainer, seen = make_with_workflow(mode="dora", n=3, steps=6, token_s=0.002)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 6, 4, 2)  # C1 from the engines' own logs: every turn of a rid on one version
    check_trajectories(trainer, seen)
    turns = [rid for e in engines.values() for op, rid, _ in e.log if op == "generate"]
    assert len(turns) >= 2 * 6 * 4 * 2  # two engine calls per trained trajectory (and more for re-runs)
    # a move ordered inside a turn carries that turn with its KV: every exported turn arrives elsewhere
    moved = {op: sorted(rid for e in engines.values() for o, rid, _ in e.log if o == op) for op in ("export", "import")}
    assert moved["export"] == moved["import"]
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    assert summary["env/trajectories"] >= 48 and summary["env/turns"] == 2 * summary["env/trajectories"]
    # the recorder heard every finished trajectory: two turns each, no tools
    assert summary["turns_per_trajectory_mean"] == 2.0 and summary["tool_use_rate"] == 0.0
    assert summary["tool_latency_s_mean"] is None and summary["tokens_per_turn_mean"] > 0
    counted = sum(r.trajectories.get("trajectories", 0) for r in rt.metrics.rows)
    assert 48 <= counted <= summary["env/trajectories"]  # those that finished before the last step ended


def test_partial_mode_reruns_an_interrupted_trajectory_whole_on_the_new_version():
    """Partial rollout resumes a single-turn sample on the new weights (a C1 violation by design);
    an interrupted trajectory is run again from its prompt instead, so C1 holds."""
    rt, engines, trainer, seen = make_with_workflow(mode="partial", token_s=0.003)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_trajectories(trainer, seen)
    assert summary["env/trajectories_aborted"] > 0  # interrupts happened, mid-trajectory
    trained = [s for b in trainer.batches for s in b]
    assert len(trained) == 6 * 4 * 2 and len({s.group_id for s in trained}) == 6 * 4
    assert all(s.reward == 1.0 for s in trained)
    # the engines ran some samples on several versions (the dropped attempts), but every trained
    # trajectory is from one: both its turns were generated on the version it is trained as
    calls = [(rid, v) for e in engines.values() for op, rid, v in e.log if op == "generate"]
    rerun = {rid for rid, v in calls if any(r == rid and w != v for r, w in calls)}
    assert {s.group_id for s in trained} & {rid.rsplit(".", 1)[0] for rid in rerun}
    # each trained sample's two turns on the version it is trained as (partial mode may re-run a
    # group's samples on different versions: a sample's version is its own)
    whole = {(rid, v) for rid, v in calls if calls.count((rid, v)) >= 2}
    for g in {s.group_id for s in trained}:
        versions = sorted(s.version for s in trained if s.group_id == g)
        assert any(sorted(v for rid, v in pick) == versions and len({rid for rid, _ in pick}) == 2
                   for pick in itertools.combinations([p for p in whole if p[0].rsplit(".", 1)[0] == g], 2)), g
    assert summary["c1_violations"] == 0 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0


def test_a_failed_instance_or_a_crashed_environment_reruns_the_trajectory():
    crashed: set[str] = set()

    async def crashes_once(prompt, prompt_ids, client, ctx):
        traj = await answer_then_env(prompt, prompt_ids, client, ctx)
        if prompt.index % 3 == 0 and prompt.index not in crashed:
            crashed.add(prompt.index)
            raise RuntimeError("the sandbox crashed")
        return traj

    rt, engines, trainer, seen = make_with_workflow(crashes_once, mode="dora", n=3, steps=6, token_s=0.003)
    summary = run_killing(rt, engines["e1"])
    check_run(rt, engines, trainer, 6, 4, 2)
    check_trajectories(trainer, seen)
    assert "e1" in summary["failed_instances"] and summary["env/workflow_failures"] >= 1
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_a_resume_keeps_the_finished_trajectories_masks(tmp_path):
    rt, engines, trainer, _ = make_with_workflow(mode="dora", steps=4, tmp_path=tmp_path)
    asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    rt2, engines2, trainer2, seen = make_with_workflow(mode="dora", steps=6, tmp_path=tmp_path, resume_from=2)
    state = resume(rt2, trainer2, tmp_path, 2)
    finished = state["samples"]  # the finished samples of the outstanding groups
    assert all(s["loss_mask"][-len(ENV):] == [0] * len(ENV) for s in finished)
    summary = asyncio.run(asyncio.wait_for(drive(rt2), timeout=120))
    trained = [g for b in trainer.batches[:2] + trainer2.batches for g in {s.group_id for s in b}]
    assert len(trained) == len(set(trained)) == 6 * 4 and summary["lost_groups"] == 0
    check_trajectories(trainer2, seen)
    restored = {s["sample_id"].rsplit(".", 1)[0] for s in finished} & trained_groups(trainer2)
    assert finished and restored  # some trained trajectories came from the checkpoint, mask included
    assert engine_versions(engines2)  # and the rest were generated after the resume


class _RecordingJournal:
    """Records which journal calls the runtime makes (every method accepts anything)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name)


def test_a_trajectory_is_not_journaled_so_that_after_a_crash_it_runs_again_whole():
    """The journal keeps no loss mask nor the workflow's own prompt: restoring a trajectory from it
    would train tool tokens; its groups' dispatches are still journaled (exactly-once)."""
    journal = _RecordingJournal()
    rt, engines, trainer, _ = make_with_workflow(mode="dora", n=3, steps=2, token_s=0.002, journal=journal)
    asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert "dispatch" in journal.calls and "sample" not in journal.calls
