"""`dora train` on the tiny MoE with a bf16 embedded engine and the fp32 trainer: without replay the
trainer routes some (token, layer) pairs differently from the engine; with ``algo.routing_replay``
every step replays the engine's experts and the on-policy log-prob difference shrinks."""

from __future__ import annotations

import json

import pytest

from tests.helpers.train_job import run_train

pytestmark = pytest.mark.integration

COMMON = ("run.steps=2", "model.warm_start_steps=10", "rollout.dtype=bfloat16", "controller.verify_checksums=false",
          "observability.heldout_prompts=0")


def test_bf16_engine_agreement_below_one_and_replay_lowers_the_logprob_gap(tmp_path):
    runs = {}
    for name, extra in (("measure", "algo.router_agreement=true"), ("replay", "algo.routing_replay=true")):
        (tmp_path / name).mkdir()
        proc, run_dir = run_train(tmp_path / name, *COMMON, extra, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = json.loads((run_dir / "summary.json").read_text())
    m, r = runs["measure"], runs["replay"]
    assert m["routing_replay_steps"] == 0 and r["routing_replay_steps"] == 2
    assert m["router_topk_agreement"] is not None and m["router_topk_agreement"] < 1.0
    assert r["router_topk_agreement"] < 1.0  # measured before replay in both runs
    assert m["rollout_vs_trainer_logprob_diff_steps"] > 0 and r["rollout_vs_trainer_logprob_diff_steps"] > 0
    assert r["rollout_vs_trainer_logprob_diff_mean"] < m["rollout_vs_trainer_logprob_diff_mean"]
    for s in runs.values():
        assert s["lost_groups"] == 0 and s["duplicated_groups"] == 0
