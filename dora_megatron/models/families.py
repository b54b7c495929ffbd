"""One table row per supported model family: what differs between Qwen3, Qwen3-MoE, Qwen2-MoE,
Mixtral, GLM-4.5 and DeepSeek-V3, read by every component that builds or names the model.

WHY a table: the trainer (Megatron-Core config and layer spec), the converters and the weight sync
(HF <-> Megatron tensor names in :mod:`dora_megatron.weights.naming`) and the embedded engine
(:mod:`dora_megatron.rollout.engine.model`) must agree on each family's facts. A ``model_type``
branch in each of them would drift; here each fact is a field, :func:`family` is the one lookup,
and :mod:`dora_megatron.models.hf_config` copies the facts a component needs into its
``ModelSpec``. Adding a family whose pieces already exist is adding a row.

Why no bridge library (mbridge, Megatron-Bridge) does this: neither runs on CPU (mbridge
hard-codes Transformer Engine layer specs and ``.cuda()``, Megatron-Bridge imports Transformer
Engine unconditionally and pins ``transformers<5``); the README says more.

Fields, by what reads them:

* HF config -> facts (``hf_config.spec_from_transformers``): ``experts_attr`` (the expert count),
  ``expert_ffn_attr`` (one expert's hidden width), ``norm_topk_prob_attr`` (None: the family
  always renormalises the top-k weights, ``renormalise``), ``qkv_bias_attr`` / ``qkv_bias_default``,
  ``o_bias_attr`` (an output-projection bias switch), ``shared_expert_attr`` (the shared expert's
  width; None: no shared expert), ``sparse_rule`` (which layers are MoE).
* HF config -> routing (``router`` ``sigmoid``): ``n_group`` / ``topk_group``, ``routed_scaling_factor``
  and ``e_score_correction_bias`` are read when the config has them.
* HF tensor names (``ModelSpec.expected_shapes``, ``naming``, the engine's module names):
  ``moe_module`` (the MoE block under ``model.layers.N.``), ``expert_proj`` (gate, up, down names
  of one expert), ``qk_norm``.
* Megatron-Core (``trainer.megatron_args``): ``qk_norm`` -> ``qk_layernorm``, qkv bias ->
  ``add_qkv_bias``, ``router`` + renormalisation -> ``moe_router_score_function`` /
  ``moe_router_pre_softmax``, shared expert -> ``moe_shared_expert_intermediate_size`` /
  ``moe_shared_expert_gate``; ``attention`` ``mla`` -> ``MLATransformerConfig`` and the MLA layer
  spec; ``router`` ``sigmoid`` -> ``moe_router_score_function="sigmoid"`` with the expert bias,
  groups and scaling factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``softmax``: softmax over all experts' logits, top-k of the probabilities, renormalised to sum
#: 1 when the family/config says so (Megatron: score function softmax; ``pre_softmax`` iff not
#: renormalised, since softmax over the top-k logits equals the renormalised top-k probabilities).
#: ``sigmoid``: sigmoid of each expert's logit; the top-k chosen on the scores plus a per-expert
#: correction bias (``e_score_correction_bias``, a buffer) within the best ``topk_group`` of
#: ``n_group`` groups, weighted by the unbiased scores, renormalised, times ``routed_scaling_factor``
#: (GLM-4.5 / DeepSeek-V3; Megatron: score function sigmoid, ``moe_router_enable_expert_bias``).
RouterKind = Literal["softmax", "sigmoid"]

#: ``gqa``: q/k/v projections (grouped-query attention, Megatron's fused ``linear_qkv``);
#: ``mla``: DeepSeek's multi-latent attention (low-rank q and kv, a decoupled rotary part;
#: Megatron's ``MLATransformerConfig`` and ``MLASelfAttention``).
AttentionKind = Literal["gqa", "mla"]

#: ``all``: every layer is MoE (Mixtral); ``qwen``: a layer is MoE unless listed in
#: ``mlp_only_layers`` and iff ``(i + 1) % decoder_sparse_step == 0`` (Qwen2/3-MoE modelling code).
#: ``first_k_dense``: the first ``first_k_dense_replace`` layers dense, the rest MoE (GLM-4.5,
#: DeepSeek-V3 modelling code: ``layer_idx >= first_k_dense_replace``).
SparseRule = Literal["all", "qwen", "first_k_dense"]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class (``architectures[0]`` of its config.json)
    qk_norm: bool = False
    qkv_bias_attr: str | None = None
    qkv_bias_default: bool = False
    o_bias_attr: str | None = None
    experts_attr: str | None = None  # None: a dense family
    expert_ffn_attr: str = "moe_intermediate_size"
    norm_topk_prob_attr: str | None = "norm_topk_prob"
    renormalise: bool = False  # used when norm_topk_prob_attr is None
    router: RouterKind = "softmax"
    shared_expert_attr: str | None = None
    shared_expert_gate: bool = False
    #: the shared expert's width is this count times one expert's (GLM-4.5's ``n_shared_experts``);
    #: used instead of ``shared_expert_attr`` when set
    shared_expert_count_attr: str | None = None
    shared_expert_module: str = "shared_expert"  # HF module under the MoE block (GLM: ``shared_experts``)
    qk_norm_attr: str | None = None  # a config switch for QK-norm (GLM: ``use_qk_norm``); None: ``qk_norm``
    sparse_rule: SparseRule = "qwen"
    moe_module: str = "mlp"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    attention: AttentionKind = "gqa"

    @property
    def is_moe(self) -> bool:
        return self.experts_attr is not None


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    # Qwen3: QK-norm; attention_bias puts a bias on q, k, v and o.
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, qkv_bias_attr="attention_bias", o_bias_attr="attention_bias"),
    # Qwen3-MoE: Qwen3 attention, softmax top-k router renormalised iff norm_topk_prob, no shared expert.
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, qkv_bias_attr="attention_bias",
           o_bias_attr="attention_bias", experts_attr="num_experts"),
    # Qwen2-MoE: q/k/v bias (``qkv_bias``, always on in transformers 4.x), no QK-norm, a shared expert
    # behind a sigmoid gate, softmax router not renormalised by default (norm_topk_prob false).
    Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias_attr="qkv_bias", qkv_bias_default=True,
           experts_attr="num_experts", shared_expert_attr="shared_expert_intermediate_size", shared_expert_gate=True),
    # Mixtral: every layer MoE, experts w1 (gate) / w3 (up) / w2 (down) under ``block_sparse_moe``,
    # top-k softmax always renormalised; an expert's width is ``intermediate_size``.
    Family("mixtral", "MixtralForCausalLM", experts_attr="num_local_experts", expert_ffn_attr="intermediate_size",
           norm_topk_prob_attr=None, renormalise=True, sparse_rule="all", moe_module="block_sparse_moe",
           expert_proj=("w1", "w3", "w2")),
    # GLM-4.5 (Glm4MoeForCausalLM): partial rotary (``partial_rotary_factor``), QK-norm iff
    # ``use_qk_norm``, q/k/v bias iff ``attention_bias`` (no o_proj bias), the first
    # ``first_k_dense_replace`` layers dense, ``n_shared_experts`` ungated shared experts under
    # ``mlp.shared_experts``, sigmoid routing with ``mlp.gate.e_score_correction_bias``.
    Family("glm4_moe", "Glm4MoeForCausalLM", qk_norm_attr="use_qk_norm", qkv_bias_attr="attention_bias",
           experts_attr="n_routed_experts", router="sigmoid", shared_expert_count_attr="n_shared_experts",
           shared_expert_module="shared_experts", sparse_rule="first_k_dense"),
    # DeepSeek-V3 (and Kimi-K2, which saves the same layout under model_type deepseek_v3):
    # multi-latent attention, ``n_shared_experts`` ungated shared experts under ``shared_experts``,
    # a sigmoid router with a correction bias and group-limited top-k, the first
    # ``first_k_dense_replace`` layers dense.
    Family("deepseek_v3", "DeepseekV3ForCausalLM", experts_attr="n_routed_experts", router="sigmoid",
           shared_expert_count_attr="n_shared_experts", shared_expert_module="shared_experts",
           sparse_rule="first_k_dense", attention="mla"),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

#: families checked and refused, with what is missing (read in Megatron-Core 0.16.1's source)
REFUSED: dict[str, str] = {
    "gpt_oss": (
        "gpt-oss needs attention sinks, alternating sliding-window layers, a clamped SwiGLU with "
        "biases (and on the router) and YaRN RoPE. Megatron-Core 0.16.1 has config fields for them "
        "(softmax_type='learnable', window_size/window_attn_skip_freq, quick_gelu with "
        "activation_func_clamp_value and glu_linear_offset, add_bias_linear) but its local (CPU) "
        "DotProductAttention allocates the learnable softmax offset (the sinks) on "
        "torch.cuda.current_device(), and neither this trainer nor the embedded engine builds "
        "sinks, sliding windows or the clamped SwiGLU (and the trainer takes the default RoPE only)"),
}


def family(model_type: object, where: str = "config.json") -> Family:
    """The family of ``model_type``; ValueError naming ``where`` and the supported types."""
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None and isinstance(model_type, str) and model_type in REFUSED:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported: {REFUSED[model_type]} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if fam is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return fam
