"""Token-budget micro-batching gives the loss and gradients of the fixed plan (real Megatron, gloo).

One long-tailed batch on the tiny MoE preset: its metrics and every parameter's reduced gradient
(``TrainerWorker.accumulate_gradients``, no optimizer step) under the fixed plan (2 rows per
micro-batch, all padded to the longest sample) and under token budgets that group the samples
differently (6, 4 and 2 micro-batches), for each length normalisation; then the same batch on 2
ranks (DP=2 with EP=2: the expert group spans the DP ranks, so every rank's k-th micro-batch must
have the same shape) against the 1-rank fixed plan, and a dense model in a 2-stage pipeline (the
budget plan's micro-batches differ in shape, so the stages exchange each activation's shape:
Megatron's ``variable_seq_lengths``) against the same pipeline's fixed plan. Equal to fp32 rounding
(~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.trainer_scenarios import run_scenario

pytestmark = pytest.mark.integration

NORMS = ("token_mean", "seq_mean", "constant")
BUDGETS = (32, 64, 100000)


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("grouping") / "one.pt")
    args = ["grouping", "--hf", model_dir, "--micro-batch-size", "2", "--no-distributed-optimizer",
            "--budgets", ",".join(str(b) for b in (0,) + BUDGETS), "--length-norms", ",".join(NORMS)]
    return run_scenario(args, 1, out)["grouping"]


def assert_same_step(got: dict, want: dict) -> None:
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "tis_weight", "num_tokens", "num_samples"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], abs=1e-6, rel=1e-6), key
    shared = sorted(set(got["grads"]) & set(want["grads"]))
    assert len(shared) > len(got["grads"]) // 2  # the comparison covers most parameters
    for name in shared:
        torch.testing.assert_close(got["grads"][name], want["grads"][name], rtol=1e-5, atol=2e-6, msg=name)


def test_token_budgets_give_the_fixed_plans_loss_and_gradients(one_rank):
    for norm in NORMS:
        fixed = one_rank[(norm, 0)]
        assert max(g.abs().max().item() for g in fixed["grads"].values()) > 1e-2  # gradients are not trivial
        counts = set()
        for budget in BUDGETS:
            packed = one_rank[(norm, budget)]
            assert_same_step(packed, fixed)
            counts.add(packed["micro_batches"])
        assert len(counts) == len(BUDGETS)  # each budget grouped the samples differently
    # every budget cuts padding; the small ones most
    fixed_pad = one_rank[("token_mean", 0)]["metrics"]["padding_fraction"]
    assert one_rank[("token_mean", 32)]["metrics"]["padding_fraction"] < fixed_pad / 3
    assert one_rank[("token_mean", 100000)]["metrics"]["padding_fraction"] < fixed_pad


def test_data_and_expert_parallel_budget_plan_matches_one_rank(one_rank, model_dir, tmp_path):
    args = ["grouping", "--hf", model_dir, "--micro-batch-size", "2", "--no-distributed-optimizer",
            "--ep", "2", "--budgets", "64", "--length-norms", "token_mean,seq_mean"]
    two = run_scenario(args, 2, str(tmp_path / "two.pt"))["grouping"]
    for norm in ("token_mean", "seq_mean"):
        assert_same_step(two[(norm, 64)], one_rank[(norm, 0)])


def test_pipeline_budget_plan_with_variable_shapes_matches_the_fixed_plan(tmp_path):
    from dora_megatron.models.presets import create_model_dir

    dense = str(create_model_dir("tiny-dense", tmp_path / "dense", seed=0))
    args = ["grouping", "--hf", dense, "--micro-batch-size", "2", "--no-distributed-optimizer", "--pp", "2",
            "--budgets", "0,64", "--length-norms", "seq_mean"]
    two = run_scenario(args, 2, str(tmp_path / "pp.pt"))["grouping"]
    packed, fixed = two[("seq_mean", 64)], two[("seq_mean", 0)]
    assert packed["micro_batches"] != fixed["micro_batches"]
    assert_same_step(packed, fixed)
