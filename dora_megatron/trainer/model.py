"""Build a Megatron-Core GPTModel from a Hugging Face Qwen3 / Qwen3-MoE config.

The config is read by :mod:`dora_megatron.models.hf_config` (transformers' config classes), the
same reader the embedded engine uses, so both build the model the directory describes.

WHY: the rollout engines load Hugging Face checkpoints and the trainer trains Megatron modules; the
two must be the *same function* of the weights. This module maps the HF config onto a
``TransformerConfig`` (RMSNorm, SwiGLU, RoPE, QK-norm, GQA, top-k routed experts, no dropout, no
biases) and picks the layer spec: Transformer Engine when importable on CUDA, Megatron's local
spec otherwise, with :class:`~dora_megatron.trainer.norm.RMSNorm` so that sequence parallelism
(required by Megatron for MoE with TP>1) works without TE/apex.
"""

from __future__ import annotations

import logging
import os

import torch

from dora_megatron.models import hf_config
from dora_megatron.models.hf_config import ModelSpec

logger = logging.getLogger(__name__)


def arch_from_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` if the Megatron trainer builds it, else ValueError naming every config key at fault."""
    problems = spec.trainer_problems()
    if problems:
        raise ValueError("; ".join(problems))
    return spec


def arch_from_hf_config(cfg: dict) -> ModelSpec:
    """The trainer's architecture of a ``config.json`` dictionary (read by transformers' config class)."""
    return arch_from_spec(hf_config.spec_from_dict(cfg))


def load_arch(hf_dir: str) -> ModelSpec:
    """The trainer's architecture of the HF directory ``hf_dir`` (the reader the engine uses too)."""
    spec = hf_config.read_spec(hf_dir)
    try:
        return arch_from_spec(spec)
    except ValueError as err:
        raise ValueError(f"{os.path.join(hf_dir, hf_config.CONFIG_FILE)}: {err}") from None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rows Megatron allocates: the HF vocab rounded up to a multiple of TP."""
    return -(-vocab_size // tp) * tp


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError or a broken CUDA install
        return False
    return True


def choose_spec(spec: str, device: str) -> str:
    """Resolve ``auto`` to ``te`` (TE importable and CUDA) or ``local``."""
    if spec == "auto":
        return "te" if device == "cuda" and te_available() else "local"
    return spec


def build_transformer_config(arch: ModelSpec, *, tp: int, pp: int, ep: int, device: str,
                             moe_aux_loss_coef: float = 0.0, spec: str = "local",
                             variable_seq_lengths: bool = False):
    """A ``TransformerConfig`` equivalent to the HF model (fp32 params, no dropout, deterministic).

    ``variable_seq_lengths``: micro-batches of one step have different shapes (token-budget
    micro-batching); only pipeline stages need to know (they exchange each activation's shape)."""
    from megatron.core.transformer import TransformerConfig

    variable = variable_seq_lengths and pp > 1
    if variable and arch.is_moe and device == "cpu":
        # Megatron refuses the allgather dispatcher (the one that runs on CPU) with variable lengths
        # (megatron/core/transformer/transformer_config.py, "does not support variable sequence length").
        raise ValueError("trainer.max_tokens_per_micro_batch > 0 with pp > 1 needs Megatron's variable_seq_lengths, "
                         "which the allgather MoE dispatcher used on CPU does not support: set "
                         "trainer.max_tokens_per_micro_batch: 0 or trainer.pp: 1")

    if arch.num_layers % pp:
        raise ValueError(f"num_layers={arch.num_layers} not divisible by pp={pp}")
    if arch.num_kv_heads % tp or arch.num_heads % tp:
        raise ValueError(f"heads ({arch.num_heads}/{arch.num_kv_heads} kv) not divisible by tp={tp}")
    if ep > 1 and (not arch.is_moe or arch.num_experts % ep):
        raise ValueError(f"ep={ep} needs an MoE model with experts divisible by ep")
    kwargs: dict = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=(device == "cpu"),
        # Fixed plan: every micro-batch of a step is padded to one length, so fixed p2p shapes
        # suffice (and the allgather MoE dispatcher used on CPU refuses variable lengths).
        variable_seq_lengths=variable,
        # Megatron checks the dispatcher against variable lengths even for a dense model, whose
        # default (allgather) it never uses: name one that allows them (MoE overrides it below).
        moe_token_dispatcher_type="alltoall" if variable else "allgather",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deterministic_mode=(device == "cpu"),
        transformer_impl="transformer_engine" if spec == "te" else "local",
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_score_function="softmax",
            # Qwen3-MoE: softmax over all experts, top-k, renormalise iff norm_topk_prob. Megatron's
            # pre_softmax=False (top-k logits then softmax) equals the renormalised form.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather" if device == "cpu" else "alltoall",
            moe_grouped_gemm=False,
            # Megatron requires sequence parallelism for MoE with TP>1.
            sequence_parallel=tp > 1,
        )
    return TransformerConfig(**kwargs)


def build_layer_spec(arch: ModelSpec, config, spec: str, pp_rank: int | None = None):
    """Layer/block spec; ``spec`` is ``te`` or ``local`` (see :func:`choose_spec`)."""
    num_experts = arch.num_experts or None
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                          qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from dora_megatron.trainer.norm import RMSNorm

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                     normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.submodules.q_layernorm = RMSNorm
    sub.self_attention.submodules.k_layernorm = RMSNorm
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)


def build_gpt_model(arch: ModelSpec, config, spec: str, *, tp: int, pre_process: bool, post_process: bool):
    """Construct this rank's GPTModel chunk (parameters are overwritten by HF weights afterwards)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(arch, config, spec),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
