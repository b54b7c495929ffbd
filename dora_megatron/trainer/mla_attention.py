"""Megatron's local ``DotProductAttention`` as the core attention of multi-latent attention.

WHY: Megatron-Core 0.16.1's ``MLASelfAttention`` passes ``k_channels`` (the query/key head width:
nope + rope part) and ``v_channels`` (the value head width) to its core attention, which only the
Transformer Engine attention accepts; its layer specs without TE name the local
``DotProductAttention``, which would refuse them. The local attention's arithmetic already takes
any query/key width (it reads it from the tensors) and sizes its output by ``kv_channels`` times
the heads, so with ``kv_channels = v_head_dim`` (``trainer.megatron_args.mla_kwargs``) it computes
MLA exactly; this subclass checks that and drops the two arguments. A spec module, not a patch.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` that accepts MLA's ``k_channels`` / ``v_channels`` (see module doc)."""

    def __init__(self, config, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA value head width {v_channels} != kv_channels {config.kv_channels}: the local "
                             "attention sizes its output by kv_channels")
        super().__init__(config, *args, **kwargs)
