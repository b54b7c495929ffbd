"""Per-request KV cache, allocated in fixed-size blocks, exportable for migration.

Why this layout: each request owns its keys/values so that a request can leave one instance
and continue on another (export/import) without touching other requests. Storage is one
contiguous tensor per layer whose capacity is always a whole number of blocks; the shared
:class:`BlockPool` accounts blocks so the scheduler can admit requests against a KV budget
and report usage. Attention reads a request's cache as a view (no per-step gather copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-int(num_tokens) // int(block_size))


class BlockPool:
    """Counts KV blocks of an instance; requests reserve blocks before they run."""

    def __init__(self, total_blocks: int) -> None:
        if total_blocks <= 0:
            raise ValueError("total_blocks must be > 0")
        self.total = int(total_blocks)
        self.used = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def can_reserve(self, n: int) -> bool:
        return n <= self.free

    def reserve(self, n: int) -> None:
        if n > self.free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.free} free")
        self.used += n

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


class RequestKV:
    """Keys and values of one request: per layer ``[num_kv_heads, capacity, head_dim]``."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def num_blocks(self) -> int:
        return self.capacity // self.shape.block_size

    def ensure_capacity(self, total_tokens: int) -> None:
        """Grow storage (by whole blocks, at least doubling) to hold ``total_tokens``."""
        if total_tokens <= self.capacity:
            return
        s = self.shape
        want = max(total_tokens, 2 * self.capacity)
        cap = blocks_for(want, s.block_size) * s.block_size
        new_k, new_v = [], []
        for layer in range(s.num_layers):
            k = torch.empty((s.num_kv_heads, cap, s.head_dim), dtype=s.dtype, device=s.device)
            v = torch.empty_like(k)
            if self.length:
                k[:, : self.length] = self.k[layer][:, : self.length]
                v[:, : self.length] = self.v[layer][:, : self.length]
            new_k.append(k)
            new_v.append(v)
        self.k, self.v, self.capacity = new_k, new_v, cap

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[kv_heads, n, d]`` at positions ``length..length+n``; return views up to there."""
        n = k_new.shape[1]
        end = self.length + n
        self.k[layer][:, self.length : end] = k_new
        self.v[layer][:, self.length : end] = v_new
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def commit(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget the positions from ``n`` on (rejected draft tokens); storage is kept, since the
        request's reserved blocks still cover it and the next step writes there again."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} tokens to {n}")
        self.length = n

    def prefix_copy(self, n: int, capacity: int) -> "RequestKV":
        """A new cache holding a copy of this one's first ``n`` positions, with room for
        ``capacity`` tokens: another sequence that shares this one's first ``n`` tokens continues
        from it without computing them again."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot copy {n} positions of a KV cache of {self.length} tokens")
        out = RequestKV(self.shape)
        out.ensure_capacity(max(capacity, n, 1))
        for layer in range(self.shape.num_layers):
            out.k[layer][:, :n] = self.k[layer][:, :n]
            out.v[layer][:, :n] = self.v[layer][:, :n]
        out.length = n
        return out

    def export_tensor(self) -> torch.Tensor:
        """``[layers, 2, kv_heads, length, head_dim]`` on CPU (a copy)."""
        if self.length == 0:
            s = self.shape
            return torch.empty((s.num_layers, 2, s.num_kv_heads, 0, s.head_dim), dtype=s.dtype)
        parts = [torch.stack([k[:, : self.length], v[:, : self.length]]) for k, v in zip(self.k, self.v)]
        return torch.stack(parts).to("cpu").contiguous()

    @classmethod
    def from_tensor(cls, shape: KVShape, data: torch.Tensor) -> "RequestKV":
        expect = (shape.num_layers, 2, shape.num_kv_heads, data.shape[3] if data.dim() == 5 else -1, shape.head_dim)
        if data.dim() != 5 or tuple(data.shape) != expect:
            raise ValueError(f"KV tensor shape {tuple(data.shape)} does not match this model {expect}")
        kv = cls(shape)
        n = int(data.shape[3])
        kv.ensure_capacity(max(n, 1))
        for layer in range(shape.num_layers):
            kv.k[layer][:, :n] = data[layer, 0].to(shape.device, shape.dtype)
            kv.v[layer][:, :n] = data[layer, 1].to(shape.device, shape.dtype)
        kv.length = n
        return kv
