"""The supervised warm start actually teaches the task format (short run, tiny model)."""

from __future__ import annotations

import torch

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import RunningSumTask
from dora_megatron.models.warm_start import _batch, encode_example, warm_start
from dora_megatron.models import hf_model_dir
from dora_megatron.models.presets import create_model_dir


def test_encode_example_masks_prompt():
    ids, start = encode_example("12:", "13.")
    assert ids[0] == tok.BOS_ID and ids[-1] == tok.EOS_ID and tok.decode(ids[start:]) == "13."
    input_ids, labels, mask = _batch([(ids, start), (ids[:3], 2)])
    assert (labels[0, :start] == -100).all() and labels[0, start:].tolist() == ids[start:]
    assert mask[1].tolist() == [1, 1, 1] + [0] * (len(ids) - 3)


def test_warm_start_lowers_loss_and_rewrites_weights(tmp_path):
    torch.set_num_threads(1)
    d = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    before = hf_model_dir.load_state_dict(d)
    losses = []
    res = warm_start(d, RunningSumTask(1, 6, 1.6, 0), steps=40, batch_size=16, lr=3e-3, progress=lambda s, l: losses.append(l))
    after = hf_model_dir.load_state_dict(d)
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 * 0.6, losses
    assert 0.0 <= res.exact_short <= 1.0
