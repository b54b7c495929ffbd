"""Checksum of a set of HF-named tensors, shared by the trainer export and the rollout engines.

Why one pure function: after every weight sync the engine reports a checksum and the trainer
compares it with the checksum of what it sent; both sides must hash the same bytes the same way.
Definition: sha256 over the tensors in sorted name order; for each tensor the UTF-8 name, the
dtype string (e.g. ``torch.float32``), the shape, each followed by a NUL byte, then the raw bytes
of the contiguous CPU tensor. The result is a lowercase hex string.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex digest over ``name, dtype, shape, bytes`` of every tensor in sorted name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        digest.update(name.encode("utf-8") + b"\0")
        digest.update(str(t.dtype).encode("ascii") + b"\0")
        digest.update(",".join(str(s) for s in t.shape).encode("ascii") + b"\0")
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
