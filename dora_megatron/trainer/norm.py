"""RMSNorm for Megatron's local spec that allows sequence parallelism and matches Hugging Face.

WHY: Megatron's ``WrappedTorchNorm`` (the local-spec norm when neither TE nor apex is installed)
refuses ``sequence_parallel=True``, but Megatron requires sequence parallelism for MoE with TP>1.
RMSNorm is per token, so it is correct on a sequence shard as long as its weight gradient is
all-reduced over the TP group; Megatron's ``finalize_model_grads`` does that for parameters
flagged ``sequence_parallel`` (and for q/k layernorms by name). The arithmetic mirrors
``Qwen3RMSNorm`` (fp32 variance, then weight * normalized) so logits match transformers.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)``, computed in fp32, usable with sequence parallel."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
