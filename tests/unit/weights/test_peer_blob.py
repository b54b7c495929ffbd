"""The peer-copy byte stream: valid safetensors, parsed back exactly, malformed input rejected."""

from __future__ import annotations

import pytest
import torch

from dora_megatron.rollout.engine.peer_weights import Blob, parse


def _state():
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a.weight": torch.randn(7, generator=g),
            "c.idx": torch.arange(4), "d.empty": torch.zeros(0, 2)}


def _bytes(blob: Blob) -> bytearray:
    out = bytearray()
    for c in blob.chunks():
        out += c
    return out


def test_round_trip_and_safetensors_compatible():
    from safetensors.torch import load

    state = _state()
    blob = Blob(state, "7", "abc")
    raw = _bytes(blob)
    assert len(raw) == blob.nbytes
    for decoded in (parse(raw), load(bytes(raw))):
        assert sorted(decoded) == sorted(state)
        for k, t in state.items():
            assert decoded[k].dtype == t.dtype and decoded[k].shape == t.shape and torch.equal(decoded[k], t)


def test_malformed_rejected():
    raw = _bytes(Blob(_state(), "7", "abc"))
    with pytest.raises(ValueError, match="do not fit"):
        parse(raw[:-4])  # truncated data
    with pytest.raises(ValueError, match="header length"):
        parse(raw[:20])
    with pytest.raises(ValueError):
        parse(bytearray(b"\x01"))
