"""``TrainerConfig`` + the model's config -> the keyword arguments of Megatron-Core's config classes.

WHY one module: the trainer builds three Megatron dataclasses (``TransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig``) from one typed section; every typed key maps
to its Megatron fields here and nowhere else, and ``trainer.megatron`` (any other field of those
classes) is applied on top, to each class that has the field. The names of ``trainer.megatron`` are
checked against the dataclasses' own ``dataclasses.fields`` (Megatron is imported lazily, so the
config package stays Megatron-free), so a misspelt field is refused before the job starts, naming
the closest real one.

The functions return plain dicts; :func:`dora_megatron.trainer.model.build_transformer_config` and
the worker construct the classes (whose ``__post_init__`` then applies Megatron's own rules).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch

from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.models.hf_config import ModelSpec

#: ``trainer.precision`` -> parameter / compute dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
            "apply_rope_fusion", "gradient_accumulation_fusion", "moe_permute_fusion")


def megatron_classes() -> dict[str, type]:
    """The Megatron config dataclasses ``trainer.megatron`` may address (imports Megatron)."""
    import warnings

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected off GPU
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig

    return {"TransformerConfig": TransformerConfig, "OptimizerConfig": OptimizerConfig,
            "DistributedDataParallelConfig": DistributedDataParallelConfig}


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def megatron_field_problems(overrides: dict[str, Any], path: str = "trainer.megatron") -> list[str]:
    """Why names of ``overrides`` are not fields of any Megatron config class (empty: all are)."""
    if not overrides:
        return []
    known: set[str] = set()
    for cls in megatron_classes().values():
        known |= field_names(cls)
    problems = []
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"{path}.{name}: not a field of Megatron-Core's TransformerConfig, OptimizerConfig or "
                            f"DistributedDataParallelConfig{hint}")
    return problems


def _overrides_for(cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    names = field_names(cls)
    return {k: v for k, v in overrides.items() if k in names}


def dispatcher(cfg: TrainerConfig) -> str:
    """``trainer.moe_token_dispatcher`` with ``auto`` resolved (allgather on cpu, alltoall on cuda)."""
    if cfg.moe_token_dispatcher != "auto":
        return cfg.moe_token_dispatcher
    return "alltoall" if cfg.device == "cuda" else "allgather"


def fusions_on(cfg: TrainerConfig, spec: str) -> bool:
    """``trainer.fusions`` resolved: null = on with the Transformer Engine spec."""
    return cfg.fusions if cfg.fusions is not None else spec == "te"


def uses_sequence_parallel(cfg: TrainerConfig, arch: ModelSpec) -> bool:
    """Explicit ``trainer.sequence_parallel``, or forced: Megatron requires it for MoE with TP > 1."""
    return cfg.tp > 1 and (cfg.sequence_parallel or arch.is_moe)


def router_kwargs(arch: ModelSpec) -> dict[str, Any]:
    """Megatron's router fields for the family's router kind (models.families.RouterKind).

    ``softmax``: softmax over all experts, top-k, renormalise iff norm_topk_prob; Megatron's
    pre_softmax=False (top-k logits then softmax) equals the renormalised form. ``sigmoid``: the
    correction bias is Megatron's ``expert_bias`` buffer, held fixed (update rate 0) so the policy
    routes as the checkpoint does; Megatron's aux-loss-free balancing would move it every step
    (``trainer.megatron.moe_router_bias_update_rate`` turns that on, and the weight push carries the
    moved bias). Group-limited top-k and the scaling factor only where the config asks for them."""
    if arch.router == "softmax":
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob)
    grouped = arch.router_groups > 1
    return dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=arch.router_expert_bias, moe_router_bias_update_rate=0.0,
                moe_router_num_groups=arch.router_groups if grouped else None,
                moe_router_group_topk=arch.router_group_topk if grouped else None,
                moe_router_topk_scaling_factor=arch.routed_scaling_factor if arch.routed_scaling_factor != 1.0 else None)


def transformer_kwargs(arch: ModelSpec, cfg: TrainerConfig, spec: str) -> dict[str, Any]:
    """Keyword arguments of ``TransformerConfig`` equivalent to the HF model under ``cfg``."""
    variable = cfg.max_tokens_per_micro_batch > 0 and cfg.pp > 1
    moe_dispatcher = dispatcher(cfg)
    if variable and arch.is_moe and moe_dispatcher == "allgather":
        # Megatron refuses the allgather dispatcher with variable lengths
        # (megatron/core/transformer/transformer_config.py, "does not support variable sequence length").
        raise ValueError("trainer.max_tokens_per_micro_batch > 0 with pp > 1 needs Megatron's variable_seq_lengths, "
                         "which the allgather MoE dispatcher does not support: set trainer.moe_token_dispatcher: "
                         "alltoall, trainer.max_tokens_per_micro_batch: 0 or trainer.pp: 1")
    dtype = DTYPES[cfg.precision]
    fused = fusions_on(cfg, spec)
    kwargs: dict[str, Any] = dict(
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
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        expert_model_parallel_size=cfg.ep,
        context_parallel_size=cfg.cp,
        expert_tensor_parallel_size=cfg.expert_tp if arch.is_moe else None,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        sequence_parallel=uses_sequence_parallel(cfg, arch),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
        use_cpu_initialization=(cfg.device == "cpu"),
        # Fixed plan: every micro-batch of a step is padded to one length, so fixed p2p shapes
        # suffice; token-budget micro-batches differ in shape and a pipeline must send each one's.
        variable_seq_lengths=variable,
        # Megatron checks the dispatcher against variable lengths even for a dense model, whose
        # dispatcher it never uses: name one that allows them (MoE overrides it below).
        moe_token_dispatcher_type="alltoall" if variable else "allgather",
        deterministic_mode=(cfg.device == "cpu"),
        transformer_impl="transformer_engine" if spec == "te" else "local",
        **{name: fused for name in _FUSIONS},
    )
    if cfg.vpp > 1:
        # Megatron-LM's interleaving defaults: overlapped, unbatched p2p. Batched p2p pairs the two
        # messages a 2-stage ring sends to the same peer (activation and gradient) in the wrong order.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if cfg.recompute != "none":
        kwargs["recompute_granularity"] = cfg.recompute
        if cfg.recompute == "full":
            kwargs["recompute_method"] = cfg.recompute_method
            kwargs["recompute_num_layers"] = cfg.recompute_num_layers
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            **router_kwargs(arch),
            moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
            moe_shared_expert_gate=arch.shared_expert_gate,
            # which layers are MoE (1) or dense (0): Qwen's mlp_only_layers / decoder_sparse_step
            moe_layer_freq=[int(i in arch.sparse_layers) for i in range(arch.num_layers)],
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=moe_dispatcher,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
        )
        if moe_dispatcher == "flex":
            kwargs["moe_flex_dispatcher_backend"] = "deepep"
    else:
        kwargs["moe_permute_fusion"] = False
    if arch.is_mla:
        kwargs.update(mla_kwargs(arch))
    kwargs.update(yarn_kwargs(arch))
    kwargs.update(_overrides_for(transformer_config_class(arch), cfg.megatron))
    return kwargs


def transformer_config_class(arch: ModelSpec) -> type:
    """Megatron's config class of ``arch``: ``MLATransformerConfig`` for multi-latent attention,
    :class:`~dora_megatron.trainer.yarn_config.YarnTransformerConfig` for YaRN without it."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if arch.is_mla:
        return MLATransformerConfig
    if arch.rope_type == "yarn":
        from dora_megatron.trainer.yarn_config import YarnTransformerConfig

        return YarnTransformerConfig
    return TransformerConfig


def position_embedding_type(arch: ModelSpec) -> str:
    """GPTModel's ``position_embedding_type``: ``yarn`` builds Megatron's ``YarnRotaryEmbedding``
    from the config's ``yarn_*`` fields; MLA builds its own rotary embedding from its config
    (GPTModel builds none for it under ``rope``)."""
    return "yarn" if arch.rope_type == "yarn" and not arch.is_mla else "rope"


def yarn_kwargs(arch: ModelSpec) -> dict[str, Any]:
    """Megatron's YaRN fields for ``arch`` (empty without YaRN): ``MLATransformerConfig``'s
    (``rotary_scaling_factor``, ...) for multi-latent attention, ``YarnTransformerConfig``'s
    ``yarn_*`` fields otherwise, as transformers resolves them (``ModelSpec.yarn``).

    The cos/sin scaling (transformers' ``attention_factor``) is the mscale ratio when both mscales
    are given, else ``0.1 ln(factor) + 1``: Megatron's GPT path takes the default when either
    ``yarn_mscale`` is None, its MLA path when the pair is (1, 0). RoPE fusion is off: TE's fused
    RoPE refuses a scaling other than 1."""
    if arch.rope_type != "yarn":
        return {}
    y = arch.yarn
    if arch.is_mla:
        return dict(rope_type="yarn", rotary_scaling_factor=y.factor,
                    original_max_position_embeddings=y.original_max_position_embeddings,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale if y.mscale_pair else 1.0,
                    mscale_all_dim=y.mscale_all_dim, apply_rope_fusion=False)
    return dict(yarn_rotary_scaling_factor=y.factor,
                yarn_original_max_position_embeddings=y.original_max_position_embeddings,
                yarn_beta_fast=y.beta_fast, yarn_beta_slow=y.beta_slow,
                yarn_mscale=y.mscale if y.mscale_pair else None,
                yarn_mscale_all_dim=y.mscale_all_dim if y.mscale_pair else None,
                yarn_correction_range_round_to_int=y.truncate, apply_rope_fusion=False)


def mla_kwargs(arch: ModelSpec) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of a multi-latent attention model (DeepSeek-V3's names ->
    Megatron's: qk_nope_head_dim -> qk_head_dim, qk_rope_head_dim -> qk_pos_emb_head_dim). RoPE
    ``default`` is Megatron's ``rope``; ``yarn``'s fields come from :func:`yarn_kwargs`."""
    return dict(
        multi_latent_attention=True, q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
        kv_channels=arch.v_head_dim, num_query_groups=arch.num_heads, rotary_base=arch.rope_theta,
        rope_type="rope", apply_rope_fusion=False)


def optimizer_kwargs(cfg: TrainerConfig) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``OptimizerConfig`` (Adam; bf16/fp16 = fp32 main params and grads)."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs: dict[str, Any] = dict(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip, use_distributed_optimizer=cfg.use_distributed_optimizer,
        params_dtype=DTYPES[cfg.precision], bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16",
        overlap_param_gather=cfg.overlap_param_gather,
    )
    if cfg.optimizer_cpu_offload:
        # Megatron's recipe: the HybridDeviceOptimizer with precision-aware state, the whole state offloaded
        kwargs.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)
    kwargs.update(_overrides_for(OptimizerConfig, cfg.megatron))
    return kwargs


def ddp_kwargs(cfg: TrainerConfig) -> dict[str, Any]:
    """Keyword arguments of ``DistributedDataParallelConfig`` (gradients reduced and kept in fp32)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs: dict[str, Any] = dict(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather, use_distributed_optimizer=cfg.use_distributed_optimizer,
        average_in_collective=False)
    kwargs.update(_overrides_for(DistributedDataParallelConfig, cfg.megatron))
    return kwargs


def scheduler_kwargs(cfg: TrainerConfig, total_steps: int) -> dict[str, Any]:
    """Keyword arguments of Megatron's ``OptimizerParamScheduler`` (steps are optimizer updates).

    ``lr_decay_steps`` 0 means ``total_steps`` (the run's steps); weight decay is constant."""
    decay_steps = cfg.lr_decay_steps or max(total_steps, cfg.lr_warmup_steps + 1)
    return dict(init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr,
                min_lr=cfg.min_lr,
                lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=cfg.lr_decay,
                start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay_steps,
                wd_incr_style="constant",
                use_checkpoint_opt_param_scheduler=cfg.use_checkpoint_opt_param_scheduler,
                override_opt_param_scheduler=cfg.override_opt_param_scheduler)


def schedule_differences(cfg: TrainerConfig, current: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """The settings in which ``current`` (this run's ``OptimizerParamScheduler.state_dict()``) and
    ``saved`` (a checkpoint's) differ, one line each, named by this section's keys with both values.

    WHY: Megatron's ``load_state_dict`` stops at the first difference and names it by its own words
    ("total number of iterations"); a user needs the keys to change and every one at once. The
    decay length is named with ``run.steps`` when ``lr_decay_steps`` is 0 (it follows the run's steps)."""
    decay = ("trainer.lr_decay_steps" if cfg.lr_decay_steps
             else "the decay length (trainer.lr_decay_steps 0: run.steps)")
    names = {"max_lr": "trainer.lr", "min_lr": "trainer.min_lr", "lr_warmup_steps": "trainer.lr_warmup_steps",
             "lr_decay_style": "trainer.lr_decay", "lr_decay_steps": decay, "start_wd": "trainer.weight_decay",
             "end_wd": "trainer.weight_decay", "wd_incr_steps": decay, "wd_incr_style": "the weight-decay schedule"}
    lines: dict[str, str] = {}  # one line per key (weight decay and the decay length are two fields each)
    for field, name in names.items():
        if field in saved and saved[field] != current.get(field) and name not in lines:
            lines[name] = f"{name}: {current.get(field)!r} in this run, {saved[field]!r} in the checkpoint"
    return list(lines.values())
