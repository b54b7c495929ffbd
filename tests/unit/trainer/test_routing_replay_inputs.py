"""Routing replay inputs: the engine's rows in Megatron's [layer, seq, batch, k] order, padding filled."""

import pytest
import torch

from dora_megatron.comm.routed_experts import encode_routed_experts
from dora_megatron.trainer.routing_replay import micro_batch_routing, sample_routing


def test_rows_land_at_their_positions_and_padding_gets_fixed_experts():
    a = torch.tensor([[[3, 1], [2, 0]], [[1, 2], [0, 3]]])  # 2 positions, 2 layers, k=2
    b = torch.tensor([[[0, 3], [1, 2]]])  # 1 position
    targets, known = micro_batch_routing([a, None, b], seq_len=3, num_layers=2, top_k=2)
    assert targets.shape == (2, 3, 3, 2)
    assert targets[0, 1, 0].tolist() == [1, 2] and targets[1, 0, 0].tolist() == [2, 0]
    assert targets[1, 0, 2].tolist() == [1, 2]
    assert targets[0, 2, 0].tolist() == [0, 1] and targets[0, 0, 1].tolist() == [0, 1]  # filler
    assert known.T.tolist() == [[True, True, False], [False, False, False], [True, False, False]]


def test_sample_routing_decodes_sglang_base64_and_needs_the_whole_sequence():
    rows = [[[3, 1], [2, 0]], [[1, 2], [0, 3]]]
    text = encode_routed_experts([v for r in rows for l in r for v in l])
    assert sample_routing(text, 2, 2, 2, "s").tolist() == rows
    assert sample_routing(rows, 2, 2, 2, "s").tolist() == rows
    with pytest.raises(ValueError, match="sample 7: routed_experts has 2 positions, replay needs 5"):
        sample_routing(text, 2, 2, 5, "sample 7")
