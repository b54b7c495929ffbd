"""What a training step costs: peak memory, model FLOPs, the GPU's peak rate (for the MFU).

WHY here: the worker reports ``perf/trainer_peak_memory_bytes``, ``perf/trainer_tokens_per_s`` and
``perf/trainer_mfu`` every step, and the memory bench and the docs use the same measures. Memory is
CUDA's ``max_memory_allocated`` on a GPU and the process's peak resident set (``VmHWM``) on CPU; both
are reset at the start of each step, so a step reports its own peak (on CPU the peak can never be
below what the process already holds: the allocator keeps freed pages).

Model FLOPs count the matrix multiplications of the forward pass over the real tokens (no padding,
no recompute): ``2 x`` the active matmul parameters per token (attention projections, the router,
the ``top_k`` routed experts or the dense MLP, the output layer) plus causal attention
(``QK^T`` and ``AV`` over half of the ``n x n`` scores: ``2 n^2 d_attn`` per layer); a training step
is 3 forwards (forward + backward) plus the log-prob forward when the loss needs one.
"""

from __future__ import annotations

import time
from typing import Sequence

#: Dense bf16/fp16 tensor-core peak of one GPU, TFLOP/s (vendor data sheets, SXM parts, no sparsity).
PEAK_TFLOPS_16BIT = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
                     "L40S": 362.0, "A10": 125.0}


def clock(device: str) -> float:
    """Seconds, after the device finished its queued work."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def reset_peak_memory(device: str) -> None:
    """Start a new peak: CUDA's allocator statistics, or (Linux) the process's peak RSS."""
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def peak_memory_bytes(device: str) -> int:
    """Peak since :func:`reset_peak_memory`: CUDA allocated bytes, or peak resident bytes on CPU."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def matmul_params_per_token(arch) -> int:
    """Weights each token multiplies in one forward pass (experts: only its ``top_k``)."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * d * (arch.num_heads + 2 * arch.num_kv_heads) + arch.num_heads * d * h
    dense_mlp = 3 * h * arch.intermediate_size
    # an MoE layer: router, the top_k experts, the shared expert and its gate (Qwen2-MoE)
    moe_mlp = (h * arch.num_experts + arch.top_k * 3 * h * arch.moe_intermediate_size
               + 3 * h * arch.shared_expert_intermediate_size + (h if arch.shared_expert_gate else 0))
    sparse = len(arch.sparse_layers) if arch.is_moe else 0  # an MoE may have dense layers (mlp_only_layers)
    return arch.num_layers * attn + sparse * moe_mlp + (arch.num_layers - sparse) * dense_mlp + h * arch.vocab_size


def forward_flops(arch, seq_len: int) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` tokens (see the module docstring)."""
    dense = 2.0 * matmul_params_per_token(arch) * seq_len
    attention = 2.0 * arch.num_layers * seq_len * seq_len * arch.num_heads * arch.head_dim
    return dense + attention


def peak_flops_per_gpu(cfg) -> float | None:
    """``trainer.peak_tflops``, else the 16-bit peak of the CUDA device by name; None when unknown
    (CPU, fp32 without ``peak_tflops``, an unlisted GPU)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if cfg.device != "cuda" or cfg.precision == "fp32":
        return None
    import torch

    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS_16BIT.items():
        if key in name:
            return tflops * 1e12
    return None


def step_perf(lengths: Sequence[int], seconds: float, peak_memory: float, arch, forwards: float, world_size: int,
              peak_flops: float | None) -> dict[str, float]:
    """``perf/trainer_*`` of a step of samples of ``lengths`` tokens that took ``seconds`` (the
    recorder logs ``perf/*`` keys under their own name): ``peak_memory`` (bytes, the max over
    ranks), tokens/s and, with a known ``peak_flops`` per GPU, the MFU of ``forwards`` forward
    passes' FLOPs (a backward counts as two) over ``world_size`` GPUs."""
    out = {"perf/trainer_peak_memory_bytes": peak_memory,
           "perf/trainer_tokens_per_s": sum(lengths) / seconds if seconds > 0 else float("nan")}
    if peak_flops and seconds > 0:
        flops = forwards * sum(forward_flops(arch, n) for n in lengths)
        out["perf/trainer_mfu"] = flops / (seconds * world_size * peak_flops)
    return out
