"""Per-rank memory of the Megatron trainer, estimated from the model's config and the trainer section.

WHY: a layout that does not fit the GPU fails minutes into a job (after the engines and the trainer
ranks are up) with a CUDA out-of-memory deep in torchrun's output. ``dora train --dry-run`` prints
this estimate and refuses a layout whose estimate exceeds ``cluster.gpu_memory_gb``. Pure Python
(no torch): the dry run of a 30B config runs on a laptop. The formula is written out in
``docs/trainer.md``; ``tools/trainer_memory_bench.py`` compares it with measured CPU peaks.

The rank estimated is the first pipeline stage (it holds the embedding and, under 1F1B, the most
micro-batches in flight) and, with ``pp == 1``, also the last (the logits). Terms, in bytes:

* **parameters**: this rank's share (dense weights / (tp * pp), experts / (ep * etp * pp), the
  vocabulary rows / tp) x 4 (fp32) or 2 (bf16 / fp16);
* **gradients**: the same count x 4 (Megatron's fp32 ``main_grad`` buffers);
* **optimizer**: Adam's two moments (8 bytes) plus, in bf16/fp16, the fp32 main parameters (4),
  divided over the data-parallel ranks by the distributed optimizer (dense weights over
  ``world / (tp * pp * cp)``, experts over ``world / (ep * etp * pp)``); 0 with
  ``trainer.optimizer_cpu_offload`` (host memory);
* **activations** of the tokens one micro-batch holds per rank (``T``: ``micro_batch_size *
  max_seq_len`` or the token budget, divided by ``cp``), per layer and token, the tensors autograd
  keeps for the backward pass (see :func:`layer_activation_bytes`), times the layers of the stage
  and the micro-batches in flight (``pp`` under 1F1B, ``pp * (1 + (pp - 1) / (pp * vpp))`` with
  interleaving); under ``recompute: full`` a layer keeps only its input and one recomputed chunk is
  live at a time; under ``selective`` the attention scores are recomputed;
* **backward workspace**: ``2 x`` one layer's activations (while a layer runs backward, the gradients
  of its saved tensors sit next to them, and a recomputed layer's temporaries), plus under
  ``selective`` two copies of one layer's attention scores (the recomputed pre- and post-softmax);
* **logits** (last stage): ``T x vocab / tp`` in fp32, four copies live while the log-probs and the
  entropy are computed;
* **overhead**: a fixed 2.5 GiB per GPU (CUDA context, NCCL buffers, allocator fragmentation), 0 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3
CUDA_OVERHEAD_BYTES = int(2.5 * GIB)
#: fp32 copies of the [T, vocab/tp] logits alive while log-probs and entropy are computed
LOGIT_COPIES = 4
#: one layer's activations, in layers, that the backward pass of a layer holds besides the saved ones
#: (the gradients of its saved tensors, and the softmax's second copy); calibrated on CPU, see
#: docs/results/trainer_memory.md
WORKSPACE_LAYERS = 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by term (see the module docstring)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    logits: float
    overhead: float
    param_count: float  # parameters held by this rank
    tokens: int  # tokens of one micro-batch on this rank

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.workspace + self.logits
                + self.overhead)

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("backward workspace", self.workspace), ("logits", self.logits),
                ("overhead", self.overhead),
                ("total", self.total)]


def _dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def rank_params(arch, cfg, stage_layers: float | None = None) -> tuple[float, float]:
    """(dense, expert) parameters held by a first-stage rank holding ``stage_layers`` transformer
    layers (None: Megatron's even split, ``L / pp``)."""
    tp, etp = cfg.tp, cfg.etp or cfg.tp
    h, d = arch.hidden_size, arch.head_dim
    layers = arch.num_layers / cfg.pp if stage_layers is None else stage_layers
    attn = _mla_params(arch, tp) if getattr(arch, "is_mla", False) else (
        (h * d * (arch.num_heads + 2 * arch.num_kv_heads) + arch.num_heads * d * h) / tp + 2 * h + 2 * d)
    vocab = -(-arch.vocab_size // tp) * tp
    embed = vocab * h / tp
    if arch.is_moe:
        # per layer on average: an MoE may have dense layers (mlp_only_layers), a shared expert (TP-split)
        sparse = len(arch.sparse_layers) / arch.num_layers
        shared = 3 * h * arch.shared_expert_intermediate_size / tp + (h if arch.shared_expert_gate else 0)
        dense_layer = attn + sparse * (h * arch.num_experts + shared) + (1 - sparse) * 3 * h * arch.intermediate_size / tp
        expert_layer = sparse * arch.num_experts / cfg.ep * 3 * h * arch.moe_intermediate_size / etp
    else:
        dense_layer = attn + 3 * h * arch.intermediate_size / tp
        expert_layer = 0.0
    dense = layers * dense_layer + embed
    if cfg.pp == 1:
        dense += h + (0 if arch.tie_word_embeddings else embed)  # final norm and output layer here too
    return dense, layers * expert_layer


def _mla_params(arch, tp: int) -> float:
    """One multi-latent attention layer's parameters on a TP rank (every projection TP-split by its
    output, Megatron's local spec), with the layer's two norms and the latents' norms."""
    h, nh = arch.hidden_size, arch.num_heads
    qr, kr, rope = arch.q_lora_rank, arch.kv_lora_rank, arch.qk_rope_head_dim
    q_head = arch.qk_nope_head_dim + rope
    q = (h * qr + qr * nh * q_head) / tp + qr if qr else h * nh * q_head / tp
    kv = (h * (kr + rope) + kr * nh * (arch.qk_nope_head_dim + arch.v_head_dim)) / tp + kr
    return q + kv + nh * arch.v_head_dim * h / tp + 2 * h


def _mla_activations(arch, tp: int, wide: int) -> float:
    """Elements per token one MLA layer keeps: the norm's input and output (2h), the q and kv
    latents before and after their norms (2 q_lora + kv_lora + rope + kv_lora), the up-projected q
    (nh (nope + rope)) and kv (nh (nope + v)), query and key after RoPE (2 nh (nope + rope)), the
    value (nh v) and the context (nh v)."""
    nh, q_head = arch.num_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    latents = 2 * arch.q_lora_rank + 2 * arch.kv_lora_rank + arch.qk_rope_head_dim
    heads = nh * q_head + nh * (arch.qk_nope_head_dim + arch.v_head_dim) + 2 * nh * q_head + 2 * nh * arch.v_head_dim
    return 2 * arch.hidden_size / wide + latents + heads / tp


def layer_activation_bytes(arch, cfg, tokens: int, spec: str) -> tuple[float, float, float]:
    """(whole layer, the part ``recompute: selective`` drops, the layer's input) in bytes for
    ``tokens`` tokens on one rank.

    Elements kept per token (``s`` the sequence length, ``tp`` split under sequence parallelism for
    the ``h``-wide tensors, always for the head- and ffn-wide ones): attention: the norm's input and
    output (2h), q/k before their norm and RoPE ((nh + ng) d), q, k, v after RoPE ((nh + 2 ng) d),
    the context (nh d), and with Megatron's local (unfused) attention the softmax output (nh s);
    dense MLP: norm input and output (2h), fc1 output (2f), fc2 input (f); MoE: norm input and
    output (2h), the router's fp32 scores (E), and per routed token (``T k etp / tp`` of them on a
    rank with balanced routing) the permuted input and the output (2h), fc1 output (2 f_e / etp),
    fc2 input (f_e / etp)."""
    a = _dtype_bytes(cfg.precision)
    tp, etp = cfg.tp, cfg.etp or cfg.tp
    sp = tp > 1 and (cfg.sequence_parallel or arch.is_moe)
    wide = tp if sp else 1  # h-wide tensors are split over TP only under sequence parallelism
    h, d, nh, ng = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    seq = cfg.max_seq_len / cfg.cp
    if getattr(arch, "is_mla", False):
        attn = _mla_activations(arch, tp, wide)
    else:
        attn = 2 * h / wide + ((nh + ng) * d + (nh + 2 * ng) * d + nh * d) / tp
    scores = nh * seq / tp if spec == "local" else 0.0  # TE's fused attention keeps O(s) statistics only
    if arch.is_moe:
        routed = arch.top_k * etp / tp
        mlp = 2 * h / wide + 4 * arch.num_experts / a + routed * (2 * h + 3 * arch.moe_intermediate_size / etp)
        mlp += 3 * arch.shared_expert_intermediate_size / tp  # the shared expert's fc1 output and fc2 input
    else:
        mlp = 2 * h / wide + 3 * arch.intermediate_size / tp
    layer = tokens * a * (attn + scores + mlp)
    return layer, tokens * a * scores, tokens * a * h / wide


def micro_batch_tokens(cfg) -> int:
    """Tokens of the largest micro-batch on one rank (before the split over ``cp``)."""
    if cfg.max_tokens_per_micro_batch:
        return cfg.max_tokens_per_micro_batch
    return cfg.micro_batch_size * cfg.max_seq_len


def planned_spec(cfg) -> str:
    """The layer spec the ranks will use: ``te`` on cuda unless ``trainer.spec: local`` (the machine
    running the dry run need not have Transformer Engine)."""
    return "local" if cfg.spec == "local" or cfg.device == "cpu" else "te"


def estimate(arch, cfg, world_size: int, spec: str | None = None, stage_layers: float | None = None) -> MemoryEstimate:
    """The per-rank estimate for ``world_size`` trainer ranks under the trainer section ``cfg``
    (``spec`` None: :func:`planned_spec`). ``stage_layers``: the transformer layers of the first
    pipeline rank under an uneven split, as Megatron builds them
    (:func:`dora_megatron.trainer.pipeline_split.trainer_split`); None: the even ``L / pp``."""
    spec = spec or planned_spec(cfg)
    dense, expert = rank_params(arch, cfg, stage_layers)
    count = dense + expert
    params = count * _dtype_bytes(cfg.precision)
    grads = count * 4
    per_param = 8 + (0 if cfg.precision == "fp32" else 4)
    if cfg.optimizer_cpu_offload:
        optimizer = 0.0
    elif cfg.use_distributed_optimizer:
        dp = max(1, world_size // (cfg.tp * cfg.pp * cfg.cp))
        edp = max(1, world_size // (cfg.ep * (cfg.etp or cfg.tp) * cfg.pp))
        optimizer = per_param * (dense / dp + expert / edp)
    else:
        optimizer = per_param * count
    tokens = max(1, micro_batch_tokens(cfg) // cfg.cp)
    layer, scores, layer_input = layer_activation_bytes(arch, cfg, tokens, spec)
    stage_layers = arch.num_layers / cfg.pp if stage_layers is None else stage_layers
    in_flight = cfg.pp * (1 + (cfg.pp - 1) / (cfg.pp * cfg.vpp)) if cfg.vpp > 1 else cfg.pp
    if cfg.recompute == "full":
        n = min(cfg.recompute_num_layers, stage_layers)
        if cfg.recompute_method == "uniform":
            kept = stage_layers * layer_input
        else:  # block: the first n layers keep their input, the others everything
            kept = n * layer_input + (stage_layers - n) * layer
        activations = in_flight * kept + n * layer  # plus one recomputed chunk during its backward
    else:
        per_layer = layer - scores if cfg.recompute == "selective" else layer
        activations = in_flight * stage_layers * per_layer
    vocab = -(-arch.vocab_size // cfg.tp) * cfg.tp
    logits = LOGIT_COPIES * 4 * tokens * vocab / cfg.tp if cfg.pp == 1 else 0.0
    workspace = WORKSPACE_LAYERS * layer
    if cfg.recompute == "selective":  # the recomputed attention rebuilds its scores (pre- and post-softmax)
        workspace += 2 * scores
    overhead = CUDA_OVERHEAD_BYTES if cfg.device == "cuda" else 0.0
    return MemoryEstimate(params, grads, optimizer, activations, workspace, logits, overhead, count, tokens)


def format_estimate(est: MemoryEstimate, gpu_memory_gb: float = 0.0) -> str:
    """The dry run's table: one line per term, GiB, and the fit against ``gpu_memory_gb``."""
    count = f"{est.param_count / 1e9:.2f} B" if est.param_count >= 1e9 else f"{est.param_count / 1e6:.1f} M"
    lines = [f"trainer memory estimate per rank ({count} parameters, {est.tokens} tokens per micro-batch):"]
    for name, value in est.rows():
        lines.append(f"  {name:20s} {value / GIB:9.2f} GiB" if value >= GIB / 10 else
                     f"  {name:20s} {value / 1024 ** 2:9.2f} MiB")
    if gpu_memory_gb:
        verdict = "fits" if est.total <= gpu_memory_gb * GIB else "DOES NOT FIT"
        lines.append(f"  cluster.gpu_memory_gb {gpu_memory_gb:g} GiB: {verdict}")
    return "\n".join(lines)
