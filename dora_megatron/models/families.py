"""One table row per supported model family: what differs between Qwen3, Qwen3-MoE, Qwen2-MoE and
Mixtral, read by every component that builds or names the model.

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
* HF tensor names (``ModelSpec.expected_shapes``, ``naming``, the engine's module names):
  ``moe_module`` (the MoE block under ``model.layers.N.``), ``expert_proj`` (gate, up, down names
  of one expert), ``qk_norm``.
* Megatron-Core (``trainer.megatron_args``): ``qk_norm`` -> ``qk_layernorm``, qkv bias ->
  ``add_qkv_bias``, ``router`` + renormalisation -> ``moe_router_score_function`` /
  ``moe_router_pre_softmax``, shared expert -> ``moe_shared_expert_intermediate_size`` /
  ``moe_shared_expert_gate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``softmax``: softmax over all experts' logits, top-k of the probabilities, renormalised to sum
#: 1 when the family/config says so (Megatron: score function softmax; ``pre_softmax`` iff not
#: renormalised, since softmax over the top-k logits equals the renormalised top-k probabilities).
RouterKind = Literal["softmax"]

#: ``all``: every layer is MoE (Mixtral); ``qwen``: a layer is MoE unless listed in
#: ``mlp_only_layers`` and iff ``(i + 1) % decoder_sparse_step == 0`` (Qwen2/3-MoE modelling code).
SparseRule = Literal["all", "qwen"]


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
    sparse_rule: SparseRule = "qwen"
    moe_module: str = "mlp"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

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
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(model_type: object, where: str = "config.json") -> Family:
    """The family of ``model_type``; ValueError naming ``where`` and the supported types."""
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return fam
