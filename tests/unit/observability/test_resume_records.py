"""A resumed run re-does the steps after its checkpoint: steps.jsonl and TensorBoard keep only the
re-done records (the crashed lineage's ones would otherwise show every such step twice)."""

from __future__ import annotations

import json

from dora_megatron.controller.outputs import drop_steps_from
from dora_megatron.observability.tensorboard import TensorBoardWriter
from tests.helpers.tensorboard_read import read_scalar_tags


def test_steps_after_the_checkpoint_are_dropped_from_steps_jsonl(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) for s in range(6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "rew')  # the crash tore the last line
    assert drop_steps_from(path, 4) == 3
    assert path.read_text().splitlines() == lines[:4]
    assert drop_steps_from(tmp_path / "absent.jsonl", 4) == 0


def test_tensorboard_shows_each_re_done_step_once(tmp_path):
    first = TensorBoardWriter(tmp_path / "tb")
    for step in range(6):  # the crashed lineage got to step 5
        first.scalars(step, {"reward/mean": 0.0})
    first.close()
    resumed = TensorBoardWriter(tmp_path / "tb", purge_step=4)  # resumed from the checkpoint at version 4
    for step in range(4, 8):
        resumed.scalars(step, {"reward/mean": 1.0})
    resumed.close()
    assert read_scalar_tags(tmp_path / "tb")["reward/mean"] == [(s, 0.0) for s in range(4)] + [(s, 1.0) for s in range(4, 8)]


def test_a_resume_at_a_checkpoint_boundary_records_each_step_once(tmp_path):
    """The crashed lineage recorded step 4 (the first after checkpoint v4) before it died; the
    resume trains step 4 again on the groups the checkpoint kept. The record must list it once."""
    from dora_megatron.controller.outputs import open_run_records

    def rec(step):
        return json.dumps({"step": step, "groups": [f"g{2 * step}", f"g{2 * step + 1}"], "versions": [step, step]})

    (tmp_path / "consumed.jsonl").write_text("".join(rec(s) + "\n" for s in range(5)))
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    steps, consumed = open_run_records(tmp_path, 4)
    for s in (4, 5):  # the resumed lineage: step 4 again, on the same groups and versions, then 5
        consumed.write(rec(s) + "\n")
        steps.write(json.dumps({"step": s}) + "\n")
    steps.close()
    consumed.close()
    records = [json.loads(x) for x in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    assert [json.loads(x)["step"] for x in (tmp_path / "steps.jsonl").read_text().splitlines()] == list(range(6))
    new_steps, new_consumed = open_run_records(tmp_path, None)  # a fresh run starts both records empty
    new_steps.close()
    new_consumed.close()
    assert (tmp_path / "consumed.jsonl").read_text() == ""


def test_a_group_trained_before_and_after_a_resume_is_counted_once_as_a_duplicate(tmp_path):
    """The summary's ``duplicated_groups`` is counted over the run's step records, the steps before
    the checkpoint (read back from steps.jsonl) included: a group the resumed lineage trains again
    after the crashed one trained it before the checkpoint is seen."""
    from dora_megatron.observability.recorder import MetricsRecorder, StepsJsonl, read_step_rows
    from dora_megatron.observability.summary import RunTotals

    def step(rec, k, groups):
        rec.step_trained(k, end_s=10.0 * (k + 1), wait_s=0.0, train_s=1.0, tokens=10, staleness=[0] * len(groups),
                         rewards=[1.0], response_lengths=[5], live_versions=1, groups=groups, versions=[k] * len(groups))

    def duplicated(rec):
        return rec.summary(mode="dora", max_staleness=1, tbs=2, rbs=1, wall_time_s=1.0,
                           totals=RunTotals(dispatched_groups=6, consumed_groups=6))["duplicated_groups"]

    first = MetricsRecorder(slots_per_instance=1, rebalancer=False, sinks=[StepsJsonl(open(tmp_path / "steps.jsonl", "w"))])
    step(first, 0, ["g0", "g1"])
    step(first, 1, ["g2", "g3"])
    first.sinks[0].close()
    resumed = MetricsRecorder(slots_per_instance=1, rebalancer=False)
    resumed.load_state_dict(first.state_dict(), rows=read_step_rows(tmp_path / "steps.jsonl", 2))
    step(resumed, 2, ["g4", "g5"])
    assert duplicated(resumed) == 0
    step(resumed, 3, ["g1", "g6", "g3"])  # two groups the steps before the checkpoint trained
    assert duplicated(resumed) == 2
