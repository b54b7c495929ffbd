"""A workflow's trajectory between turns: off its instance (its slot free for other work), placed
again for its next turn on an instance of its own version, counted when that is another instance,
and never lost (a failed environment, a checkpoint taken between turns)."""

import json

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.orchestrator import Orchestrator, Submit


def _orch(instances=("a",), cap=1, tbs=1, **cfg):
    config = OrchestratorConfig(mode="dora", tbs=tbs, rbs=8, max_staleness=1, group_size=1, cap_before_rebalance=cap,
                                cap_after_rebalance=cap, rebalance_interval_s=0, **cfg)
    o = Orchestrator(config, list(instances))
    return o, o.start()


def _submits(actions):
    return [a for a in actions if isinstance(a, Submit)]


def test_a_trajectory_between_turns_frees_its_slot_for_another_sample():
    o, first = _orch()
    (a,) = _submits(first)  # one slot: one sample runs
    assert not _submits(o.poll())
    other = _submits(o.on_turn_ended(a.sample_id))  # its tool runs: the slot is free
    assert [s.instance for s in other] == ["a"] and other[0].sample_id != a.sample_id
    assert o.sample_status(a.sample_id)["state"] == "waiting" and o.audit() == 0
    assert not _submits(o.on_turn_ready(a.sample_id))  # the slot is taken now: its next turn waits
    assert o.sample_status(a.sample_id)["state"] == "pending"
    again = _submits(o.on_sample_finished(other[0].sample_id))
    assert [(s.sample_id, s.instance, s.version) for s in again][:1] == [(a.sample_id, "a", a.version)]
    assert o.summary()["workflow_turn_moves"] == 0  # the same instance as its last turn


def test_the_next_turn_moves_to_another_instance_of_its_version_and_is_counted():
    o, first = _orch(instances=("a", "b"), tbs=2)
    by_instance = {s.instance: s for s in _submits(first)}
    assert set(by_instance) == {"a", "b"}
    x = by_instance["a"]
    filler = _submits(o.on_turn_ended(x.sample_id))  # a's slot goes to new work
    assert [s.instance for s in filler] == ["a"]
    assert not _submits(o.on_turn_ready(x.sample_id))  # no room anywhere: it waits for its version
    moved = _submits(o.on_sample_finished(by_instance["b"].sample_id))
    assert (moved[0].sample_id, moved[0].instance, moved[0].version) == (x.sample_id, "b", x.version)
    assert o.summary()["workflow_turn_moves"] == 1
    assert o.summary()["lost_groups"] == 0


def test_the_next_turn_goes_back_to_its_instance_when_it_has_room():
    o, first = _orch(instances=("a", "b"), cap=2)
    x = next(s for s in _submits(first) if s.instance == "a")
    o.on_turn_ended(x.sample_id)
    back = _submits(o.on_turn_ready(x.sample_id))
    assert [(s.sample_id, s.instance) for s in back] == [(x.sample_id, "a")]
    assert o.summary()["workflow_turn_moves"] == 0


def test_the_next_turn_keeps_the_trajectorys_version_after_a_newer_one_exists():
    """The staleness bound and the admission rule apply to the trajectory: its later turns run on
    the version of its first, even once the trainer produced newer weights."""
    o, first = _orch(instances=("a", "b"), cap=4)
    x = _submits(first)[0]
    o.on_turn_ended(x.sample_id)
    for s in list(_submits(first))[1:]:
        o.on_sample_finished(s.sample_id)
    assert o.trainer_busy  # a batch of other groups went to the trainer
    o.on_step_finished(1)
    nxt = _submits(o.on_turn_ready(x.sample_id))
    mine = [s for s in nxt if s.sample_id == x.sample_id]
    pending = o.sample_status(x.sample_id)
    assert all(s.version == x.version == 0 for s in mine) and pending["version"] == 0
    assert pending["min_version"] == pending["max_version"] == 0


def test_a_failed_environment_between_turns_queues_the_sample_again():
    o, first = _orch(cap=2)
    x = _submits(first)[0]
    o.on_turn_ended(x.sample_id)
    o.on_migration_failed(x.sample_id)  # the runtime's report of a crashed environment
    assert o.sample_status(x.sample_id)["state"] in ("pending", "running") and o.audit() == 0
    assert o.summary()["workflow_turn_moves"] == 0  # run again from its prompt: not a turn move


def test_a_snapshot_between_turns_restores_the_trajectory_as_queued():
    o, first = _orch(cap=1)
    x = _submits(first)[0]
    o.on_turn_ended(x.sample_id)
    snap = json.loads(json.dumps(o.snapshot()))
    r = Orchestrator.restore(o.config, snap)
    assert r.sample_status(x.sample_id)["state"] == "pending" and r.audit() == 0
