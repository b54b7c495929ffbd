"""The embedded engine's logits for every position of one sequence: the oracle of the parity and
speculation tests (one ragged forward of the sequence alone, from an empty KV cache)."""

from __future__ import annotations

from typing import Sequence

import torch

from dora_megatron.rollout.engine.kv_cache import RequestKV
from dora_megatron.rollout.engine.model import CausalLM


@torch.inference_mode()
def full_logits(model: CausalLM, token_ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    kv = RequestKV(model.kv_shape(block_size))
    kv.ensure_capacity(len(token_ids))
    dev = model.model.embed_tokens.weight.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)
    pos = torch.arange(len(token_ids), device=dev)
    return model.logits(model.forward_segments(ids, pos, [(kv, len(token_ids))])).float()
