"""Routed experts on the wire (SGLang 0.5.23's encoding) and the EPLB physical -> logical map.

WHY: routing replay (R3) needs, per token and per MoE layer, the top-k expert ids the rollout
engine used. SGLang returns them when a ``/generate`` request sets ``return_routed_experts``
(server flag ``--enable-return-routed-experts``): ``meta_info.routed_experts`` is the base64 of
the raw bytes of an ``int32`` array of shape ``(tokens, num_hidden_layers, top_k)`` covering the
sequence positions ``[routed_experts_start_len, seqlen - 1)`` (the last sampled token is never
fed, so it has no routing). Row ``t`` is the routing of the token at position
``routed_experts_start_len + t`` as an *input*; ``start_len`` must lie in ``[0, prompt_tokens]``.
The embedded engine speaks the same encoding, so client, journal and trainer have one decoder.

EPLB: with ``--enable-eplb`` / ``--ep-num-redundant-experts`` SGLang dispatches to *physical*
expert slots (several replicas of one logical expert). In 0.5.23 the capture site
(``capture_routed_experts_if_allowed`` in ``layers/moe/topk.py::_post_process_topk_ids``) runs
*before* ``topk_ids_logical_to_physical``, so ``routed_experts`` already holds logical ids (the
trainer's experts). :func:`physical_to_logical` maps ids for an engine that reports physical
slots (a capture after dispatch), given its per-layer ``physical_to_logical_map`` (SGLang's
``ExpertLocationMetadata.physical_to_logical_map``, shape ``(layers, num_physical_experts)``).

Stdlib only: the controller decodes without torch.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Sequence

#: Row filler for layers without routed experts (dense MLP layers) and for positions not routed.
NO_EXPERT = -1


def encode_routed_experts(flat: Sequence[int]) -> str:
    """Base64 of the little-endian int32 bytes of ``flat`` (row-major ``(tokens, layers, top_k)``)."""
    a = array("i", flat)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def decode_routed_experts(text: str, num_layers: int, top_k: int) -> list[list[list[int]]]:
    """``meta_info.routed_experts`` -> nested ``[token][layer][slot]`` lists; ValueError on a bad size."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    width = 4 * num_layers * top_k
    if width <= 0 or len(raw) % width:
        raise ValueError(f"routed_experts has {len(raw)} bytes, not a multiple of 4 * layers({num_layers}) * "
                         f"top_k({top_k})")
    a = array("i")
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    per_tok = num_layers * top_k
    return [[list(a[t * per_tok + l * top_k: t * per_tok + (l + 1) * top_k]) for l in range(num_layers)]
            for t in range(len(a) // per_tok)]


def physical_to_logical(routed: list[list[list[int]]], phys_to_log: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Map physical expert slots to logical experts, per layer (``phys_to_log[layer][slot]``).

    ``NO_EXPERT`` stays as is; a slot outside the layer's map is an error naming layer and slot."""
    out = []
    for t, row in enumerate(routed):
        mapped = []
        for layer, ids in enumerate(row):
            table = phys_to_log[layer]
            cur = []
            for slot in ids:
                if slot == NO_EXPERT:
                    cur.append(slot)
                elif 0 <= slot < len(table):
                    cur.append(int(table[slot]))
                else:
                    raise ValueError(f"routed_experts token {t} layer {layer}: physical slot {slot} outside "
                                     f"[0, {len(table)})")
            mapped.append(cur)
        out.append(mapped)
    return out


def physical_to_logical_map(logical_of_slot: Sequence[int], num_layers: int) -> list[list[int]]:
    """The same slot -> logical table for every layer (a static placement such as SGLang's init one)."""
    return [list(logical_of_slot) for _ in range(num_layers)]
