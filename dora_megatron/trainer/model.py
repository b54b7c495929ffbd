"""Build a Megatron-Core GPTModel from a Hugging Face config of a supported family (models.families).

The config is read by :mod:`dora_megatron.models.hf_config` (transformers' config classes), the
same reader the embedded engine uses, so both build the model the directory describes.

WHY: the rollout engines load Hugging Face checkpoints and the trainer trains Megatron modules; the
two must be the *same function* of the weights. This module maps the HF config onto a
``TransformerConfig`` (RMSNorm, SwiGLU, RoPE, GQA, top-k routed experts, no dropout; QK-norm, q/k/v
biases and a (gated) shared expert as the family has them; the trainer section's knobs through :mod:`dora_megatron.trainer.megatron_args`) and picks
the layer spec: Transformer Engine when importable on CUDA, Megatron's local spec otherwise, with
:class:`~dora_megatron.trainer.norm.RMSNorm` so that sequence parallelism works without TE/apex.
"""

from __future__ import annotations

import logging
import os

from dora_megatron.config.trainer import TrainerConfig
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


def te_spec_problems(arch: ModelSpec) -> list[str]:
    """What of ``arch`` the Transformer Engine layer spec does not build here (empty: it builds all).

    WHY: the TE spec is one layer spec for every layer with Megatron's stock attention, so neither
    this trainer's MLA core attention (:mod:`dora_megatron.trainer.mla_attention`) nor a dense layer
    between MoE layers (a per-layer spec) goes into it; the local spec builds both."""
    problems = []
    if arch.is_mla:
        problems.append("multi-latent attention (kv_lora_rank) is built with the local spec only")
    if arch.is_moe and len(arch.sparse_layers) != arch.num_layers:
        problems.append("dense layers inside an MoE (mlp_only_layers / decoder_sparse_step / first_k_dense_replace) "
                        "are built with the local spec only")
    return problems


def choose_spec(spec: str, device: str, arch: ModelSpec, *, te_importable: bool) -> str:
    """``trainer.spec`` resolved for ``arch``: ``auto`` is ``te`` on CUDA when Transformer Engine
    imports and builds the model (:func:`te_spec_problems`), else ``local``; ``te`` and ``local``
    are kept (an explicit ``te`` the model cannot take fails in :func:`build_layer_spec`, naming why).

    A pure function (``te_importable`` is :func:`te_available` at the call site), so the choice
    for each model and machine is testable without either."""
    if spec != "auto":
        return spec
    if device == "cuda" and te_importable and not te_spec_problems(arch):
        return "te"
    return "local"


def build_transformer_config(arch: ModelSpec, cfg: TrainerConfig, spec: str = "local"):
    """A ``TransformerConfig`` equivalent to the HF model under the trainer section ``cfg`` (no dropout;
    precision, recompute, parallel sizes, dispatcher and fusions from ``cfg``, then ``cfg.megatron``:
    :mod:`dora_megatron.trainer.megatron_args`). Megatron's own ``__post_init__`` checks the result."""
    from dora_megatron.trainer.megatron_args import transformer_config_class, transformer_kwargs
    from dora_megatron.trainer.pipeline_split import config_problems, construct, uneven_fields

    layers = arch.num_layers
    if not uneven_fields(cfg.megatron) and layers % (cfg.pp * cfg.vpp):
        raise ValueError(f"num_hidden_layers={layers} not divisible by trainer.pp * trainer.vpp = {cfg.pp * cfg.vpp} "
                         "(Megatron splits the layers evenly over the pipeline stages unless "
                         "trainer.megatron.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage "
                         "say otherwise)")
    if not arch.is_mla and (arch.num_kv_heads % cfg.tp or arch.num_heads % cfg.tp):
        raise ValueError(f"heads ({arch.num_heads}/{arch.num_kv_heads} kv) not divisible by tp={cfg.tp}")
    if cfg.ep > 1 and (not arch.is_moe or arch.num_experts % cfg.ep):
        raise ValueError(f"ep={cfg.ep} needs an MoE model with experts divisible by ep")
    if arch.is_mla and arch.num_heads % cfg.tp:
        raise ValueError(f"heads ({arch.num_heads}) not divisible by tp={cfg.tp}")
    config = construct(transformer_config_class(arch), transformer_kwargs(arch, cfg, spec), cfg.megatron)
    problems = config_problems(config, layers, cfg.megatron, cfg.vpp)
    if problems:
        raise ValueError("; ".join(problems))
    return config


def build_layer_spec(arch: ModelSpec, config, spec: str, pp_rank: int | None = None, vp_stage: int | None = None):
    """Layer/block spec; ``spec`` is ``te`` or ``local`` (see :func:`choose_spec`)."""
    num_experts = arch.num_experts or None
    grouped = bool(getattr(config, "moe_grouped_gemm", False))
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        problems = te_spec_problems(arch)
        if problems:
            raise ValueError(f"trainer.spec: te cannot build this model: {'; '.join(problems)} "
                             "(use trainer.spec: local or auto)")
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=grouped,
                                                          qk_layernorm=arch.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from dora_megatron.trainer.norm import RMSNorm

    def local_spec(experts: int | None):
        # MLA: Megatron's "qk_layernorm" is the norm of the q and kv latents (always on in DeepSeek-V3)
        layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped,
                                         qk_layernorm=arch.qk_norm or arch.is_mla,
                                         multi_latent_attention=arch.is_mla, normalization="RMSNorm")
        sub = layer.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if arch.is_mla:
            from dora_megatron.trainer.mla_attention import MLADotProductAttention

            sub.self_attention.submodules.core_attention = MLADotProductAttention
            sub.self_attention.submodules.q_layernorm = RMSNorm
            sub.self_attention.submodules.kv_layernorm = RMSNorm
        elif arch.qk_norm:
            sub.self_attention.submodules.q_layernorm = RMSNorm
            sub.self_attention.submodules.k_layernorm = RMSNorm
        return layer

    # an MoE with dense layers (Qwen's mlp_only_layers / decoder_sparse_step): each of this chunk's
    # layers gets the MoE or the dense spec by its global index
    moe, dense = local_spec(num_experts), (local_spec(None) if num_experts else None)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = [moe if not num_experts or offset + i in arch.sparse_layers else dense for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def build_gpt_model(arch: ModelSpec, config, spec: str, *, tp: int, pre_process: bool, post_process: bool,
                    vp_stage: int | None = None):
    """Construct this rank's GPTModel chunk (parameters are overwritten by HF weights afterwards);
    ``vp_stage``: the chunk's virtual pipeline stage (interleaved schedule), None without one."""
    from megatron.core.models.gpt import GPTModel

    from dora_megatron.trainer.megatron_args import position_embedding_type

    model = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(arch, config, spec, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type=position_embedding_type(arch),  # yarn: the config's yarn_* fields
        rotary_base=int(arch.rope_theta),
        rotary_percent=arch.rotary_percent,  # partial rotary (GLM-4.5's partial_rotary_factor)
        vp_stage=vp_stage,
    )
    if position_embedding_type(arch) == "yarn" and arch.rotary_dim:  # YaRN over the rotated share only
        from dora_megatron.trainer.yarn_config import partial_rotary_yarn

        model.rotary_pos_emb = partial_rotary_yarn(config, arch.rotary_dim, arch.rope_theta)
    return model
