"""A resumed run re-does the steps after its checkpoint: steps.jsonl and TensorBoard keep only the
re-done records (the crashed lineage's ones would otherwise show every such step twice)."""

from __future__ import annotations

import json

from dora_megatron.launch.local import drop_steps_from
from dora_megatron.observability.tensorboard import TensorBoardWriter, read_scalar_tags


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
