"""Routing replay (R3) in the Megatron trainer through Megatron-Core's own ``RouterReplay``.

WHY: for MoE models the trainer and the rollout engine route tokens differently as soon as their
numerics differ (bf16 engine vs fp32 trainer, other kernels, EP layouts), and that mismatch
dominates the off-policy error. With ``TransformerConfig.moe_enable_routing_replay`` every
``TopKRouter`` owns a ``RouterReplay``; per micro-batch we hand each router of *this* rank the
engine's top-k ids for exactly the tokens it sees and set ``REPLAY_FORWARD``, so the router
gathers its scores at those experts instead of choosing its own. No Megatron code is changed.

Token order: the router flattens its input ``[s, b, h]`` to ``s * b + b_idx``; with sequence
parallelism (TP>1 with MoE) each TP rank routes its contiguous chunk of the sequence. Routers are
found on the local model (so PP stages only touch their layers) and matched to engine layers by
``layer_number - 1`` (global, 1-based in Megatron). EP changes nothing: routing happens before
the token dispatch, on global expert ids.

Padding-safe: the engine reports positions ``[0, n-1)`` of each sample; the last position and the
right padding get the fixed experts ``0..k-1``; causal attention keeps them from influencing the
real positions, and the loss never reads them.

The agreement metric (``router_topk_agreement``) uses ``RECORD``: the router computes its own
top-k and keeps it, and we compare it with the engine's on the loss positions.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dora_megatron.comm.routed_experts import decode_routed_experts


def sample_routing(routed: Any, num_layers: int, top_k: int, positions: int, where: str) -> torch.Tensor:
    """A sample's ``routed_experts`` (SGLang base64 string, nested list or tensor) -> ``[positions, L, k]`` int64.

    Replay needs every position the trainer feeds before the last one, so the engine reply must
    have been requested with ``routed_experts_start_len = 0``."""
    if isinstance(routed, str):
        rows = torch.tensor(decode_routed_experts(routed, num_layers, top_k), dtype=torch.int64)
    else:
        rows = torch.as_tensor(routed, dtype=torch.int64)
    rows = rows.reshape(-1, num_layers, top_k) if rows.numel() else rows.reshape(0, num_layers, top_k)
    if rows.shape[0] != positions:
        raise ValueError(f"{where}: routed_experts has {rows.shape[0]} positions, replay needs {positions} (prompt + "
                         "response - 1; request them with routed_experts_start_len=0)")
    return rows


def micro_batch_routing(per_row: Sequence[torch.Tensor | None], seq_len: int, num_layers: int, top_k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' ``[n_i, L, k]`` routing -> ``[L, S, B, k]`` targets and the ``[S, B]`` mask of engine-known positions."""
    b = len(per_row)
    filler = torch.arange(top_k, dtype=torch.int64)
    out = filler.expand(num_layers, seq_len, b, top_k).clone()
    known = torch.zeros(seq_len, b, dtype=torch.bool)
    for col, rows in enumerate(per_row):
        if rows is None or not rows.shape[0]:
            continue
        n = rows.shape[0]
        out[:, :n, col] = rows.permute(1, 0, 2)
        known[:n, col] = True
    return out, known


def local_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """``(engine layer index, router)`` for every routing-replay router of this rank's model chunk."""
    found = []
    for m in model.modules():
        replay = getattr(m, "router_replay", None)
        if replay is not None and getattr(m, "layer_number", None) is not None:
            found.append((int(m.layer_number) - 1, m))
    return found


def _local_chunk(t: torch.Tensor, seq_dim: int, tp: int, tp_rank: int, sequence_parallel: bool) -> torch.Tensor:
    if not sequence_parallel or tp == 1:
        return t
    return t.chunk(tp, dim=seq_dim)[tp_rank]


def set_replay(routers: list[tuple[int, Any]], targets: torch.Tensor, *, tp: int, tp_rank: int,
               sequence_parallel: bool, device: torch.device | str) -> None:
    """Make every local router use ``targets`` ``[L, S, B, k]`` for the next forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in routers:
        t = _local_chunk(targets[layer], 0, tp, tp_rank, sequence_parallel)
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(t.reshape(-1, t.shape[-1]).to(device))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def set_record(routers: list[tuple[int, Any]]) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, router in routers:
        router.router_replay.clear_indices()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)


def clear(routers: list[tuple[int, Any]]) -> None:
    """Back to the router's own top-k (and drop the held index tensors)."""
    for _, router in routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


def recorded_agreement(routers: list[tuple[int, Any]], engine: torch.Tensor, count_mask: torch.Tensor, *, tp: int,
                       tp_rank: int, sequence_parallel: bool) -> tuple[float, float]:
    """(agreeing, total) (position, layer) pairs: the routers' recorded top-k set equals the engine's.

    ``engine`` ``[L, S, B, k]``; ``count_mask`` ``[S, B]`` selects the positions to count."""
    agree, total = 0.0, 0.0
    engine, count_mask = engine.cpu(), count_mask.cpu()  # (micro-batches sit on the GPU under CUDA)
    mask = _local_chunk(count_mask, 0, tp, tp_rank, sequence_parallel).reshape(-1)
    for layer, router in routers:
        got = router.router_replay.get_recorded_indices()
        if got is None:
            continue
        ref = _local_chunk(engine[layer], 0, tp, tp_rank, sequence_parallel).reshape(-1, engine.shape[-1])
        same = (got.detach().cpu().sort(-1).values == ref.sort(-1).values).all(-1)
        agree += float(same[mask].sum())
        total += float(mask.sum())
    return agree, total
