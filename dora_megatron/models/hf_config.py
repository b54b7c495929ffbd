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
from typing import Any, Mapping

from dora_megatron.models import families

CONFIG_FILE = "config.json"

#: RoPE types the embedded engine computes (frequencies and attention scaling from transformers'
#: ``ROPE_INIT_FUNCTIONS``); ``dynamic`` / ``longrope`` change with the sequence length and are refused
ENGINE_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

#: what the trainer, the converters and the embedded engine load (one row each in :mod:`.families`)
SUPPORTED_MODEL_TYPES = families.SUPPORTED_MODEL_TYPES


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def engine_problems(self) -> list[str]:
        """What the embedded engine (and the trainer) cannot compute, each naming the config key."""
        problems = []
        if self.rope_type not in ENGINE_ROPE_TYPES:
            problems.append(f"rope_parameters.rope_type {self.rope_type!r} is not supported by the embedded engine "
                            f"(supported: {', '.join(ENGINE_ROPE_TYPES)})")
        if self.sliding_window_layers:
            problems.append(f"sliding-window attention (use_sliding_window / layer_types) on layers "
                            f"{list(self.sliding_window_layers)} is not supported")
        return problems

    def trainer_problems(self) -> list[str]:
        """What the Megatron trainer cannot build (a superset of :meth:`engine_problems`)."""
        problems = self.engine_problems()
        if self.rope_type != "default" and self.rope_type in ENGINE_ROPE_TYPES:
            problems.append(f"rope_parameters.rope_type {self.rope_type!r} is not supported by the Megatron trainer "
                            "(only 'default' RoPE)")
        if self.o_bias:
            problems.append("attention_bias=true (an o_proj bias) is not supported by the Megatron trainer")
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
                for e in range(self.num_experts):
                    q = f"{moe}experts.{e}."
                    shapes[q + f"{gate}.weight"] = (inter, h)
                    shapes[q + f"{up}.weight"] = (inter, h)
                    shapes[q + f"{down}.weight"] = (h, inter)
                if self.shared_expert_intermediate_size:
                    s_inter = self.shared_expert_intermediate_size
                    shapes[moe + "shared_expert.gate_proj.weight"] = (s_inter, h)
                    shapes[moe + "shared_expert.up_proj.weight"] = (s_inter, h)
                    shapes[moe + "shared_expert.down_proj.weight"] = (h, s_inter)
                    if self.shared_expert_gate:
                        shapes[moe + "shared_expert_gate.weight"] = (1, h)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        return shapes


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
    else:
        mlp_only = set(getattr(c, "mlp_only_layers", None) or [])
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        sparse = tuple(i for i in range(n_layers) if num_experts > 0 and i not in mlp_only and (i + 1) % step == 0)
    if fam.norm_topk_prob_attr is None:
        renormalise = fam.renormalise
    else:
        renormalise = bool(getattr(c, fam.norm_topk_prob_attr, False))
    shared = int(getattr(c, fam.shared_expert_attr, 0) or 0) if fam.shared_expert_attr and num_experts else 0
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
        head_dim=int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads),
        intermediate_size=int(c.intermediate_size),
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=int(c.max_position_embeddings),
        tie_word_embeddings=bool(c.tie_word_embeddings),
        qkv_bias=bool(getattr(c, fam.qkv_bias_attr, fam.qkv_bias_default)) if fam.qkv_bias_attr else False,
        o_bias=bool(getattr(c, fam.o_bias_attr, False)) if fam.o_bias_attr else False,
        qk_norm=fam.qk_norm,
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
    )
