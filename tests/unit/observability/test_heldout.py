"""Held-out evaluation: prompt set, buckets, snapshot lookup, and a real (tiny) model run."""

from __future__ import annotations

import pytest
import torch

from dora_megatron.data.tasks import RunningSumTask
from dora_megatron.observability.heldout import (
    HELDOUT_SEED_OFFSET, _load, bucket_of, evaluate_model, generate_responses, heldout_prompts, latest_snapshot,
)


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17, 40, 52)] == [1, 2, 4, 4, 8, 16, 52, 52, 52]


def test_heldout_prompts_are_fixed_and_not_the_training_stream():
    a = heldout_prompts("digit_cipher", 1, 40, 1.2, data_seed=0, count=50)
    assert a == heldout_prompts("digit_cipher", 1, 40, 1.2, data_seed=0, count=50)
    train = RunningSumTask(1, 40, 1.2, seed=0, kind="digit_cipher")
    assert [p.text for p in a] != [train.get(i).text for i in range(50)]
    assert a == [RunningSumTask(1, 40, 1.2, seed=HELDOUT_SEED_OFFSET, kind="digit_cipher").get(i) for i in range(50)]


def test_latest_snapshot_skips_incomplete(tmp_path):
    assert latest_snapshot(tmp_path) is None
    for v, complete in ((3, True), (12, True), (13, False)):
        d = tmp_path / "weights" / f"v{v:06d}"
        d.mkdir(parents=True)
        if complete:
            (d / "model.safetensors").write_bytes(b"x")
    assert latest_snapshot(tmp_path) == tmp_path / "weights" / "v000012"


def test_evaluate_model_counts_and_restores_the_rng(tmp_path):
    from dora_megatron.models.presets import create_model_dir

    torch.set_num_threads(1)
    d = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    prompts = heldout_prompts("digit_cipher", 1, 6, 1.2, data_seed=0, count=5)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    res = evaluate_model(d, prompts, "sample", max_new_tokens=8, batch=2)
    assert torch.equal(torch.rand(1), expected_next)  # the caller's RNG stream is untouched
    assert sum(b["prompts"] for b in res.buckets.values()) == 5
    assert 0.0 <= res.exact <= 1.0
    again = evaluate_model(d, prompts, "sample", max_new_tokens=8, batch=2)
    assert again.to_json() == res.to_json()  # same seed, same answers
    with pytest.raises(FileNotFoundError, match="no config.json"):
        evaluate_model(tmp_path / "nothing", prompts)
    with pytest.raises(ValueError, match="decode"):
        evaluate_model(d, prompts, "beam")


def test_responses_end_at_the_rollout_stop_tokens(tmp_path):
    """The evaluation decodes as the rollout does: an extra stop token ends an answer (kept)."""
    from dora_megatron.models.presets import create_model_dir

    torch.set_num_threads(1)
    model = _load(create_model_dir("tiny-dense", tmp_path / "m", seed=0))
    prompts = heldout_prompts("digit_cipher", 1, 6, 1.2, data_seed=0, count=4)
    free = generate_responses(model, prompts, "greedy", max_new_tokens=12, batch=3)
    assert all(0 < len(r) <= 12 for r in free)
    row = max(free, key=len)
    assert len(row) >= 3
    stop = row[2] if row[2] not in row[:2] else row[1]
    cut = generate_responses(model, prompts, "greedy", max_new_tokens=12, batch=3, stop_token_ids=[stop])
    for a, b in zip(free, cut):  # greedy: the same tokens up to and including the first stop token
        end = a.index(stop) + 1 if stop in a else len(a)
        assert b == a[:end]
    assert any(len(b) < len(a) for a, b in zip(free, cut))
