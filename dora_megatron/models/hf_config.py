"""The one reader of a Hugging Face ``config.json``, through transformers' own config classes.

WHY: a checkpoint's ``config.json`` has several spellings of the same fact. transformers 5.x
``save_pretrained`` writes ``num_local_experts`` and ``rope_parameters``; the Hub's Qwen3-MoE
checkpoints (written by 4.x) spell ``num_experts``, ``rope_theta`` and ``rope_scaling: null``; an
omitted key means transformers' default for that class (``norm_topk_prob`` false for Qwen3-MoE,
``head_dim`` 128 for Qwen3), not a default we would pick. Two hand-written parsers (engine and
trainer) disagreed on exactly this, so a directory one of them accepted the other read as another
model. Here the dictionary goes through ``Qwen3Config`` / ``Qwen3MoeConfig`` (what SGLang and vLLM
do via ``AutoConfig``), and :class:`ModelSpec` is built from the config *object's* attributes, so
every spelling transformers accepts means what it means to transformers. The embedded engine, the
Megatron trainer, the converter and the job's input checks all read the model through this module.

transformers is imported lazily (``import dora_megatron`` and ``dora --help`` stay light).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from dora_megatron.models import families

CONFIG_FILE = "config.json"

#: RoPE types the embedded engine computes (frequencies and attention scaling from transformers'
#: ``ROPE_INIT_FUNCTIONS``); ``dynamic`` / ``longrope`` change with the sequence length and are refused
ENGINE_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

#: what the trainer, the converters and the embedded engine load (one row each in :mod:`.families`)
SUPPORTED_MODEL_TYPES = families.SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters as transformers' ``_compute_yarn_parameters`` reads them from
    ``rope_parameters`` (defaults filled in), so the trainer maps what transformers computes, not
    what the file happens to spell.

    WHY each default: ``factor`` absent means ``max_position_embeddings /
    original_max_position_embeddings`` (DeepSeek-V3 configs); ``beta_fast`` / ``beta_slow`` absent
    or 0 mean 32 / 1; ``truncate`` absent means true (rounded correction range). ``mscale`` and
    ``mscale_all_dim`` change the cos/sin scaling only when *both* are non-zero (otherwise it is
    ``0.1 ln(factor) + 1``); ``mscale_all_dim`` alone still scales DeepSeek-V3's softmax.
    ``attention_factor`` (explicit cos/sin scaling) is kept to be refused where it cannot be built."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float  # 0: not given
    mscale_all_dim: float  # 0: not given
    truncate: bool
    attention_factor: float | None

    @property
    def mscale_pair(self) -> bool:
        """Both mscales given: the cos/sin scaling is their ratio (transformers' rule)."""
        return bool(self.mscale and self.mscale_all_dim)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts every component needs, as transformers reads ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # q/k/v projection biases
    o_bias: bool = False  # output projection bias (Qwen3's attention_bias)
    qk_norm: bool = True
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None  # of the checkpoint's tensors ("float32", "bfloat16", ...), None if not said
    initializer_range: float = 0.02
    rope_type: str = "default"
    sliding_window_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . gate)
    moe_module: str = "mlp"  # HF module of the MoE block under model.layers.N.
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # HF gate, up, down of an expert
    shared_expert_module: str = "shared_expert"  # HF module of the shared expert under the MoE block
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (partial_rotary_factor); 0: head_dim
    router: str = "softmax"  # the family's router kind (models.families.RouterKind)
    router_expert_bias: bool = False  # the router has e_score_correction_bias (sigmoid routing)
    router_groups: int = 1  # n_group: experts in this many groups, ...
    router_group_topk: int = 1  # ... of which the top-k are chosen from the best topk_group
    routed_scaling_factor: float = 1.0  # the routing weights are multiplied by it

    # multi-latent attention (models.families attention "mla"); kv_lora_rank 0: not MLA
    q_lora_rank: int = 0  # 0: a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    rope_parameters: tuple[tuple[str, Any], ...] = ()  # all of rope_parameters (YaRN's factor, mscale, ...)
    mtp_layers: int = 0  # num_nextn_predict_layers: multi-token-prediction layers, not loaded
    mla_bias: bool = False  # attention_bias on MLA's q_a / kv_a / o projections

    @property
    def rotary_percent(self) -> float:
        """The share of a head RoPE rotates (Megatron's ``rotary_percent``)."""
        return (self.rotary_dim or self.head_dim) / self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def yarn(self) -> Yarn:
        """The YaRN parameters (:class:`Yarn`); only meaningful when ``rope_type`` is ``yarn``."""
        rope = dict(self.rope_parameters)
        original = int(rope.get("original_max_position_embeddings") or self.max_position_embeddings)
        factor = rope.get("factor")
        attention_factor = rope.get("attention_factor")
        return Yarn(factor=float(factor) if factor is not None else self.max_position_embeddings / original,
                    original_max_position_embeddings=original,
                    beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                    mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                    truncate=bool(rope.get("truncate", True)),
                    attention_factor=None if attention_factor is None else float(attention_factor))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def _common_problems(self) -> list[str]:
        problems = []
        if self.sliding_window_layers:
            problems.append(f"sliding-window attention (use_sliding_window / layer_types) on layers "
                            f"{list(self.sliding_window_layers)} is not supported")
        return problems

    def engine_problems(self) -> list[str]:
        """What the embedded engine (and the trainer) cannot compute, each naming the config key."""
        problems = self._common_problems()
        if self.rope_type not in ENGINE_ROPE_TYPES:
            problems.append(f"rope_parameters.rope_type {self.rope_type!r} is not supported by the embedded engine "
                            f"(supported: {', '.join(ENGINE_ROPE_TYPES)})")
        if self.is_mla:
            problems += self._mla_problems("the embedded engine")
        return problems

    def trainer_problems(self) -> list[str]:
        """What the Megatron trainer cannot build, each naming the config key (for GQA families a
        superset of :meth:`engine_problems`; MLA has its own rules, :meth:`_mla_trainer_problems`)."""
        if self.is_mla:
            problems = self._common_problems() + self._mla_trainer_problems()
        else:
            problems = self.engine_problems()
            if self.rope_type not in ("default", "yarn") and self.rope_type in ENGINE_ROPE_TYPES:
                problems.append(f"rope_parameters.rope_type {self.rope_type!r} is not supported by the Megatron "
                                "trainer (supported: default, yarn)")
            if self.o_bias:
                problems.append("attention_bias=true (an o_proj bias) is not supported by the Megatron trainer")
        if self.rope_type == "yarn" and self.yarn.attention_factor is not None:
            problems.append(f"rope_parameters.attention_factor={self.yarn.attention_factor:g} is not supported by "
                            "the Megatron trainer (Megatron-Core 0.16.1 derives YaRN's cos/sin scaling from factor, "
                            "mscale and mscale_all_dim only)")
        if self.router == "sigmoid" and self.top_k > 1 and not self.norm_topk_prob:
            # megatron/core/transformer/moe/moe_utils.py topk_routing_with_score_function always
            # renormalises sigmoid top-k weights
            problems.append("norm_topk_prob=false with sigmoid routing is not supported by the Megatron trainer "
                            "(Megatron-Core renormalises sigmoid top-k weights)")
        if self.router_groups > 1 and self.top_k // self.router_group_topk != 2:
            # Megatron scores a group by its top (top_k // group_topk) experts, transformers by its top 2
            problems.append(f"n_group={self.router_groups} with num_experts_per_tok={self.top_k} and "
                            f"topk_group={self.router_group_topk}: the Megatron trainer scores a group by its top "
                            "num_experts_per_tok // topk_group experts, transformers by its top 2; they agree only "
                            "when that quotient is 2")
        return problems

    def _mla_problems(self, who: str) -> list[str]:
        """What neither the embedded engine nor Megatron-Core 0.16.1's MLA layer builds as
        transformers' DeepseekV3ForCausalLM does (both rotate interleaved pairs, neither has MLA
        biases), each naming the config key and ``who`` refuses it."""
        problems = []
        if self.rope_type not in ("default", "yarn"):
            problems.append(f"rope_parameters.rope_type {self.rope_type!r} with multi-latent attention is not "
                            f"supported by {who} (supported: default, yarn)")
        if not self.rope_interleave:
            problems.append(f"rope_interleave=false is not supported by {who} (it rotates interleaved pairs)")
        if self.mla_bias:
            problems.append(f"attention_bias=true with multi-latent attention is not supported by {who}")
        return problems

    def _mla_trainer_problems(self) -> list[str]:
        """What Megatron-Core 0.16.1's MLA layer computes differently from transformers'
        DeepseekV3ForCausalLM, so the trainer refuses instead of training another model."""
        problems = self._mla_problems("the Megatron trainer")
        yarn = self.yarn
        if self.rope_type == "yarn" and not yarn.truncate:
            problems.append("rope_parameters.truncate=false with multi-latent attention is not supported by the "
                            "Megatron trainer (Megatron-Core's MLA always rounds YaRN's correction range)")
        if self.rope_type == "yarn" and yarn.mscale_all_dim and not yarn.mscale:
            # transformers: cos/sin scaled by 0.1 ln(factor) + 1, the softmax by mscale_all_dim;
            # Megatron's MLA ties both to one (mscale, mscale_all_dim) pair
            problems.append("rope_parameters.mscale_all_dim without rope_parameters.mscale is not supported by the "
                            "Megatron trainer with multi-latent attention (Megatron-Core derives the cos/sin scaling "
                            "from both, transformers then uses 0.1 ln(factor) + 1)")
        if self.rms_norm_eps != 1e-6:
            problems.append(f"rms_norm_eps={self.rms_norm_eps} is not supported with multi-latent attention: "
                            "transformers normalises the q/kv latents with eps 1e-6 whatever rms_norm_eps says, "
                            "Megatron with rms_norm_eps")
        return problems

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every weight of this model (per-expert layout, as on disk)."""
        h, v, d = self.hidden_size, self.vocab_size, self.head_dim
        nh, nkv = self.num_heads, self.num_kv_heads
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.is_mla:
                shapes.update({p + k: v for k, v in self.mla_shapes().items()})
            else:
                shapes[p + "self_attn.q_proj.weight"] = (nh * d, h)
                shapes[p + "self_attn.k_proj.weight"] = (nkv * d, h)
                shapes[p + "self_attn.v_proj.weight"] = (nkv * d, h)
                shapes[p + "self_attn.o_proj.weight"] = (h, nh * d)
                if self.qk_norm:
                    shapes[p + "self_attn.q_norm.weight"] = (d,)
                    shapes[p + "self_attn.k_norm.weight"] = (d,)
                if self.qkv_bias:
                    shapes[p + "self_attn.q_proj.bias"] = (nh * d,)
                    shapes[p + "self_attn.k_proj.bias"] = (nkv * d,)
                    shapes[p + "self_attn.v_proj.bias"] = (nkv * d,)
                if self.o_bias:
                    shapes[p + "self_attn.o_proj.bias"] = (h,)
            if i in self.sparse_layers:
                inter = self.moe_intermediate_size
                moe = f"{p}{self.moe_module}."
                gate, up, down = self.expert_proj
                shapes[moe + "gate.weight"] = (self.num_experts, h)
                if self.router_expert_bias:
                    shapes[moe + "gate.e_score_correction_bias"] = (self.num_experts,)
                for e in range(self.num_experts):
                    q = f"{moe}experts.{e}."
                    shapes[q + f"{gate}.weight"] = (inter, h)
                    shapes[q + f"{up}.weight"] = (inter, h)
                    shapes[q + f"{down}.weight"] = (h, inter)
                if self.shared_expert_intermediate_size:
                    s_inter = self.shared_expert_intermediate_size
                    shared = f"{moe}{self.shared_expert_module}."
                    shapes[shared + "gate_proj.weight"] = (s_inter, h)
                    shapes[shared + "up_proj.weight"] = (s_inter, h)
                    shapes[shared + "down_proj.weight"] = (h, s_inter)
                    if self.shared_expert_gate:
                        shapes[moe + "shared_expert_gate.weight"] = (1, h)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        return shapes

    def mla_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name (under ``model.layers.N.``) -> shape of one layer's multi-latent attention weights."""
        h, nh = self.hidden_size, self.num_heads
        q_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        a = "self_attn."
        shapes = {a + "kv_a_proj_with_mqa.weight": (self.kv_lora_rank + self.qk_rope_head_dim, h),
                  a + "kv_a_layernorm.weight": (self.kv_lora_rank,),
                  a + "kv_b_proj.weight": (nh * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                  a + "o_proj.weight": (h, nh * self.v_head_dim)}
        if self.q_lora_rank:
            shapes.update({a + "q_a_proj.weight": (self.q_lora_rank, h), a + "q_a_layernorm.weight": (self.q_lora_rank,),
                           a + "q_b_proj.weight": (nh * q_head, self.q_lora_rank)})
        else:
            shapes[a + "q_proj.weight"] = (nh * q_head, h)
        return shapes


def mtp_names(names: Iterable[str], num_layers: int) -> list[str]:
    """The names of ``model.layers.N.*`` tensors with ``N >= num_layers``: DeepSeek-V3's
    multi-token-prediction layers (``num_nextn_predict_layers``), which transformers, the engine
    and the trainer skip."""
    out = []
    for name in names:
        parts = name.split(".", 3)
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() \
                and int(parts[2]) >= num_layers:
            out.append(name)
    return out


def read_json(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dictionary (FileNotFoundError / ValueError naming the file)."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {model_dir}")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def read_spec(model_dir: str | Path) -> ModelSpec:
    """:class:`ModelSpec` of the HF directory ``model_dir`` (ValueError naming the file and field)."""
    return spec_from_dict(read_json(model_dir), where=str(Path(model_dir) / CONFIG_FILE))


def transformers_config(config: Mapping[str, Any], where: str = CONFIG_FILE):
    """The transformers config object of ``config`` (``Qwen3Config``, ``MixtralConfig``, ...).

    ValueError (naming ``where``, the model type and transformers' reason, which names the field)
    for an unsupported ``model_type`` or a value transformers' validation refuses."""
    model_type = config.get("model_type")
    families.family(model_type, where)
    import transformers

    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as err:  # transformers raises TypeError, ValueError or huggingface_hub's StrictDataclassError
        raise ValueError(f"{where}: transformers {transformers.__version__} cannot read it as {model_type}: "
                         f"{' '.join(str(err).split())}") from None


def keeps_fp32(model_type: str, name: str) -> bool:
    """transformers keeps the tensor ``name`` in fp32 in a bf16/fp16 model of ``model_type`` (its
    class's ``_keep_in_fp32_modules_strict``: GLM-4.5's router ``gate.weight`` and
    ``e_score_correction_bias``), so a checkpoint it saves holds it in fp32 and a writer must too:
    the correction bias in bf16 would route tokens elsewhere."""
    import transformers

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    patterns = getattr(cls, "_keep_in_fp32_modules_strict", None) or ()
    return any(name == p or name.endswith("." + p) or f".{p}." in f".{name}" for p in patterns)


def spec_from_dict(config: Mapping[str, Any], where: str = CONFIG_FILE) -> ModelSpec:
    """:class:`ModelSpec` of a ``config.json`` dictionary, read by transformers' config class."""
    return spec_from_transformers(transformers_config(config, where), where)


def spec_from_transformers(c: Any, where: str = CONFIG_FILE) -> ModelSpec:
    """:class:`ModelSpec` from a transformers config object; attribute names of 4.x and 5.x both read.

    5.x keeps RoPE in ``rope_parameters`` (``rope_theta``, ``rope_type``); 4.x in ``rope_theta`` and
    ``rope_scaling``. ``num_experts`` is an attribute in 4.x and an alias of ``num_local_experts`` in
    5.x. The family's row (:mod:`.families`) names the attributes that differ between families and
    which decoder layers are sparse."""
    fam = families.family(c.model_type, where)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if not rope:
        rope = dict(getattr(c, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(c, "rope_theta", None))
    if rope.get("rope_theta") is None:
        raise ValueError(f"{where}: no rope_theta (rope_parameters.rope_theta or rope_theta) in the config")
    n_layers = int(c.num_hidden_layers)
    num_experts = int(getattr(c, fam.experts_attr, 0) or 0) if fam.is_moe else 0
    if fam.sparse_rule == "all":
        sparse = tuple(range(n_layers)) if num_experts else ()
    elif fam.sparse_rule == "first_k_dense":
        first_dense = int(getattr(c, "first_k_dense_replace", 0) or 0)
        sparse = tuple(range(first_dense, n_layers)) if num_experts else ()
    else:
        mlp_only = set(getattr(c, "mlp_only_layers", None) or [])
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        sparse = tuple(i for i in range(n_layers) if num_experts > 0 and i not in mlp_only and (i + 1) % step == 0)
    if fam.norm_topk_prob_attr is None:
        renormalise = fam.renormalise
    else:
        renormalise = bool(getattr(c, fam.norm_topk_prob_attr, False))
    if fam.shared_expert_count_attr and num_experts:
        shared = int(getattr(c, fam.shared_expert_count_attr, 0) or 0) * int(getattr(c, fam.expert_ffn_attr))
    else:
        shared = int(getattr(c, fam.shared_expert_attr, 0) or 0) if fam.shared_expert_attr and num_experts else 0
    head_dim = int(getattr(c, "head_dim", None) or int(c.hidden_size) // int(c.num_attention_heads))
    # transformers 5.x keeps partial_rotary_factor in rope_parameters, 4.x on the config
    partial = float(rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0)
    sigmoid = fam.router == "sigmoid" and num_experts > 0
    mla = _mla_fields(c) if fam.attention == "mla" else {}
    layer_types = list(getattr(c, "layer_types", None) or [])
    sliding = tuple(i for i, t in enumerate(layer_types) if t != "full_attention")
    if getattr(c, "sliding_window", None) is not None and not layer_types:  # Qwen3-MoE: every layer
        sliding = tuple(range(n_layers))
    eos = getattr(c, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ())
    dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
    heads = int(c.num_attention_heads)
    return ModelSpec(
        model_type=c.model_type,
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.hidden_size),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=int(c.intermediate_size),
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=int(c.max_position_embeddings),
        tie_word_embeddings=bool(c.tie_word_embeddings),
        qkv_bias=bool(getattr(c, fam.qkv_bias_attr, fam.qkv_bias_default)) if fam.qkv_bias_attr else False,
        o_bias=bool(getattr(c, fam.o_bias_attr, False)) if fam.o_bias_attr else False,
        qk_norm=bool(getattr(c, fam.qk_norm_attr, False)) if fam.qk_norm_attr else fam.qk_norm,
        num_experts=num_experts,
        top_k=int(c.num_experts_per_tok) if num_experts else 0,
        moe_intermediate_size=int(getattr(c, fam.expert_ffn_attr)) if num_experts else 0,
        norm_topk_prob=renormalise if num_experts else False,
        sparse_layers=sparse,
        eos_token_ids=eos_ids,
        dtype=None if dtype is None else str(dtype).replace("torch.", ""),
        initializer_range=float(getattr(c, "initializer_range", 0.02)),
        rope_type=str(rope.get("rope_type") or rope.get("type") or "default"),
        sliding_window_layers=sliding,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=fam.shared_expert_gate and shared > 0,
        moe_module=fam.moe_module,
        expert_proj=fam.expert_proj,
        shared_expert_module=fam.shared_expert_module,
        rotary_dim=int(head_dim * partial) if partial < 1.0 else 0,
        router=fam.router if num_experts else "softmax",
        router_expert_bias=sigmoid,
        router_groups=int(getattr(c, "n_group", 1) or 1) if sigmoid else 1,
        router_group_topk=int(getattr(c, "topk_group", 1) or 1) if sigmoid else 1,
        routed_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0) if sigmoid else 1.0,
        rope_parameters=tuple(sorted((str(k), v) for k, v in rope.items() if isinstance(v, (int, float, str, bool)))),
        mtp_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0),
        **mla,
    )


def _mla_fields(c: Any) -> dict[str, Any]:
    """The multi-latent attention facts of a DeepSeek-V3-style config object."""
    q_lora = getattr(c, "q_lora_rank", None)
    return dict(q_lora_rank=int(q_lora or 0), kv_lora_rank=int(c.kv_lora_rank),
                qk_nope_head_dim=int(c.qk_nope_head_dim), qk_rope_head_dim=int(c.qk_rope_head_dim),
                v_head_dim=int(c.v_head_dim), rope_interleave=bool(getattr(c, "rope_interleave", True)),
                mla_bias=bool(getattr(c, "attention_bias", False)))
