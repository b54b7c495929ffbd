"""`dora bench` limits on real processes: the engines alone, then the trainer alone (torchrun, the
runs' own command) on the batches recorded by that rollout pass, every child stopped after.

Shortened to one set of processes (the bench's bookkeeping around it is unit-tested in
``tests/unit/launch/test_bench.py``): an untrained tiny model, 16-token answers, 2 training steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_limits_measure_rollout_alone_then_training_on_the_recorded_batches(tmp_path):
    from dora_megatron.launch.bench import variant_config
    from dora_megatron.launch.capacity import measure_capacities
    from dora_megatron.launch.local import prepare_model

    cfg = load_config(ROOT / "configs" / "bench" / "cpu_longtail.yaml", [
        "model.warm_start=''", "orchestrator.tbs=2", "orchestrator.rbs=4", "orchestrator.group_size=2",
        "rollout.max_new_tokens=16", "rollout.max_running=4", "orchestrator.cap_before_rebalance=4",
        "orchestrator.cap_after_rebalance=4"])
    model = prepare_model(cfg, tmp_path)
    run_dir = tmp_path / "limits"
    lcfg = variant_config(cfg, "sync", 0, run_dir, model, len(os.sched_getaffinity(0)))
    lim = measure_capacities(lcfg, run_dir, model, steps=2)
    assert lim["rollout_tokens_per_s"] > 0 and lim["training_tokens_per_s"] > 0
    # 2 engines x 4 slots: at least four loops of 8 samples, enough whole groups for both batches
    assert lim["rollout_concurrency"] == 8 and lim["rollout_samples"] >= 32
    assert len(lim["train_steps"]) == 2 and all(s["tokens"] > 0 and s["seconds"] > 0 for s in lim["train_steps"])
    # the trainer trained both steps (a snapshot per version) and every child has exited
    assert (run_dir / "weights" / "v000002").is_dir()
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert logs >= {"engine0.log", "engine1.log", "trainer.log"}
