"""Per-request record of the experts every fed token was routed to (routing replay, R3).

WHY: the trainer must route each response token to exactly the experts the engine used. The
engine learns them only inside the forward pass, one chunk of positions per step (a prefill chunk
or one decode token), so each request keeps the rows for the positions its KV cache holds: row
``p`` is the routing of the token at position ``p``. The invariant ``len(trace) == kv.length``
is what makes it survive every path: a migration exports the rows with the KV, a retract
(re-prefill from position 0) truncates them and the prefill writes them again, and the reply
encodes positions ``[routed_experts_start_len, seqlen - 1)`` as SGLang 0.5.23 does
(:mod:`dora_megatron.comm.routed_experts`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dora_megatron.comm.protocol import ProtocolError
from dora_megatron.comm.routed_experts import NO_EXPERT, encode_routed_experts


class RoutingTrace:
    """Rows ``[positions, num_layers, top_k]`` int32; layers without routed experts hold ``NO_EXPERT``."""

    def __init__(self, num_layers: int, top_k: int, start_len: int = 0) -> None:
        self.num_layers, self.top_k, self.start_len = num_layers, top_k, start_len
        self._chunks: list[torch.Tensor] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def rows(self) -> torch.Tensor:
        if not self._chunks:
            return torch.empty((0, self.num_layers, self.top_k), dtype=torch.int32)
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (the KV was dropped or shortened; they are recomputed)."""
        if n < self._len:
            self._chunks = [self.rows()[:n]] if n else []
            self._len = n

    def append(self, rows: torch.Tensor) -> None:
        self._chunks.append(rows)
        self._len += rows.shape[0]

    def encode(self, end: int) -> str:
        """``meta_info.routed_experts`` for positions ``[start_len, end)``."""
        return encode_routed_experts(self.rows()[self.start_len:end].reshape(-1).tolist())

    def export(self) -> dict:
        return {"start_len": self.start_len, "rows": self.rows().clone()}

    @classmethod
    def from_export(cls, blob: object, num_layers: int, top_k: int, num_experts: int, positions: int) -> "RoutingTrace":
        """Validate an exported trace (untrusted input): ``positions`` rows of in-range ids."""
        if not isinstance(blob, dict) or not isinstance(blob.get("rows"), torch.Tensor):
            raise ProtocolError("routing must be a mapping with a 'rows' tensor")
        rows, start = blob["rows"], blob.get("start_len")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ProtocolError("routing.start_len must be an integer >= 0")
        if rows.dtype != torch.int32 or tuple(rows.shape) != (positions, num_layers, top_k):
            raise ProtocolError(f"routing.rows must be int32 of shape {[positions, num_layers, top_k]} (one row per "
                                f"cached position), got {rows.dtype} {list(rows.shape)}")
        if rows.numel() and (int(rows.min()) < NO_EXPERT or int(rows.max()) >= num_experts):
            raise ProtocolError(f"routing.rows hold expert ids outside [{NO_EXPERT}, {num_experts})")
        trace = cls(num_layers, top_k, start)
        if positions:
            trace.append(rows.contiguous())
        return trace


def split_step_routing(routing_out: dict[int, torch.Tensor], lengths: Sequence[int], num_layers: int,
                       top_k: int) -> list[torch.Tensor]:
    """The step's per-layer ``[N, top_k]`` ids -> one ``[m, num_layers, top_k]`` block per segment."""
    n = sum(lengths)
    full = torch.full((n, num_layers, top_k), NO_EXPERT, dtype=torch.int32)
    for layer, ids in routing_out.items():
        full[:, layer] = ids.cpu()
    return list(torch.split(full, list(lengths)))


def routing_trace_for(spec, start_len: int) -> RoutingTrace:
    """A trace for a request asking ``return_routed_experts`` on a model of ``spec`` (a ``ModelSpec``)."""
    if not spec.is_moe:
        raise ProtocolError("return_routed_experts needs a MoE model; this instance serves a dense model")
    return RoutingTrace(spec.num_layers, spec.top_k, start_len)
