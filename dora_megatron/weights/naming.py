"""Megatron-Core <-> Hugging Face parameter names and layouts for every supported family.

The family-specific facts (the HF MoE module and expert projection names, QK-norm, q/k/v biases, a
shared expert and its gate) come from the architecture (``ModelSpec``, filled from the family's
row in :mod:`dora_megatron.models.families`); the rules below are the same for every family.

WHY: the trainer holds Megatron tensors (fused QKV grouped per query group, fused gate/up
``linear_fc1``, per-rank TP shards, PP-local layer indices, EP-local expert indices) while the
rollout engines and checkpoints speak Hugging Face names in the per-expert layout
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``. Every conversion goes through three
pure steps so each can be tested on its own:

1. HF <-> *global* Megatron (full tensors, global layer and expert indices, local-spec names):
   :func:`hf_to_megatron_global`, :func:`megatron_global_to_hf`.
2. global <-> *rank-local* names (PP layer offset, EP expert offset): :func:`global_to_local_name`,
   :func:`local_to_global_name`.
3. full tensor <-> TP shard: :func:`shard_tp`, :func:`merge_tp`.

:func:`hf_state_dict_to_megatron` composes 1-3 for one rank; :func:`megatron_to_hf` is the inverse
for already-gathered tensors. Transformer Engine spec names (fused layernorm weights) are mapped to
the local-spec names by :func:`canonical_name`. Pure torch; no Megatron import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Protocol

import torch

# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """One rank's place in the model-parallel layout, for one model chunk.

    ``etp`` is the expert tensor-parallel size (0 = ``tp``, Megatron's default) and ``etp_rank`` this
    rank's place in it (ignored when ``etp`` is 0: the TP rank). With an interleaved pipeline
    (``vpp > 1``) a rank holds ``vpp`` chunks; ``vp_stage`` names the chunk.

    ``chunk_layers``: (first global layer, layer count) of each of this rank's chunks, by virtual
    stage, as Megatron builds them (:func:`dora_megatron.trainer.pipeline_split.staged_layout` sets
    it from Megatron's own functions; an uneven split needs it). Empty: Megatron's even split, chunk
    ``v`` of pipeline rank ``r`` holding ``L / (pp * vpp)`` layers from ``v * L / vpp + r * L / (pp * vpp)``."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 0
    etp_rank: int = 0
    vpp: int = 1
    vp_stage: int = 0
    chunk_layers: tuple[tuple[int, int], ...] = ()

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_tp_rank(self) -> int:
        return self.etp_rank if self.etp else self.tp_rank

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers of this model chunk (one pipeline stage without interleaving)."""
        if self.chunk_layers:
            return self.chunk_layers[self.vp_stage][1]
        if num_layers % (self.pp * self.vpp):
            raise ValueError(f"num_layers={num_layers} not divisible by pp*vpp={self.pp * self.vpp}")
        return num_layers // (self.pp * self.vpp)

    def layer_offset(self, num_layers: int) -> int:
        """The global index of this chunk's first layer."""
        if self.chunk_layers:
            return self.chunk_layers[self.vp_stage][0]
        per = self.layers_per_stage(num_layers)
        return self.vp_stage * per * self.pp + self.pp_rank * per

    def experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} not divisible by ep={self.ep}")
        return num_experts // self.ep

    def expert_offset(self, num_experts: int) -> int:
        return self.ep_rank * self.experts_per_rank(num_experts)

    @property
    def first_stage(self) -> bool:
        """This chunk embeds the tokens (the first chunk of the first pipeline rank)."""
        return self.pp_rank == 0 and self.vp_stage == 0

    @property
    def last_stage(self) -> bool:
        """This chunk computes the logits (the last chunk of the last pipeline rank)."""
        return self.pp_rank == self.pp - 1 and self.vp_stage == self.vpp - 1

    @property
    def last_rank(self) -> bool:
        """This rank holds the loss (the last pipeline rank, whichever chunk)."""
        return self.pp_rank == self.pp - 1

    def chunk(self, vp_stage: int) -> "Layout":
        """The layout of this rank's chunk ``vp_stage``."""
        from dataclasses import replace

        return replace(self, vp_stage=vp_stage)


class Arch(Protocol):
    """The shape facts naming reads: a :class:`NamingArch`, or a ``models.hf_config.ModelSpec``
    (which has them among others). Read-only properties, so a frozen dataclass satisfies it."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def shared_expert_intermediate_size(self) -> int: ...
    @property
    def shared_expert_gate(self) -> bool: ...
    @property
    def moe_module(self) -> str: ...
    @property
    def expert_proj(self) -> tuple[str, str, str]: ...
    @property
    def sparse_layers(self) -> tuple[int, ...] | None: ...
    @property
    def shared_expert_module(self) -> str: ...
    @property
    def router_expert_bias(self) -> bool: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def q_lora_rank(self) -> int: ...


@dataclass(frozen=True)
class NamingArch:
    """The shape facts naming needs (a subset of ``models.hf_config.ModelSpec``, duck-typed)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    moe_module: str = "mlp"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    sparse_layers: tuple[int, ...] | None = None  # the MoE layers; None: all of them when num_experts
    shared_expert_module: str = "shared_expert"
    router_expert_bias: bool = False  # sigmoid routing's e_score_correction_bias (a Megatron buffer)
    kv_lora_rank: int = 0  # > 0: multi-latent attention
    q_lora_rank: int = 0


def _is_mla(arch: Arch) -> bool:
    return arch.kv_lora_rank > 0


def is_moe_layer(arch: Arch, layer: int) -> bool:
    """Layer ``layer`` (global index) of ``arch`` is MoE (an MoE model may have dense layers)."""
    sparse = arch.sparse_layers
    return bool(arch.num_experts) and (sparse is None or layer in sparse)


# --------------------------------------------------------------------------- names

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")

# TE-spec suffix -> local-spec suffix (within a layer).
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

# Simple one-to-one per-layer renames, Megatron (local spec) -> HF.
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


#: Megatron's router keeps the sigmoid routing's correction bias as a buffer, not a parameter: the
#: loaders and exporters carry the buffers this predicate names next to the parameters
ROUTER_BIAS = "mlp.router.expert_bias"


def is_carried_buffer(name: str) -> bool:
    """A Megatron buffer that is a model weight (HF ``e_score_correction_bias``), loaded and exported."""
    return name.endswith("." + ROUTER_BIAS)


# Multi-latent attention (DeepSeek-V3), Megatron (local spec) -> HF; every projection keeps its
# layout (q_b / kv_b rows per head [nope | rope] and [k_nope | v], kv_a rows [latent | rope], as
# Megatron splits them), so each is a rename. The latents' norms replace Qwen's q/k norms.
_MLA_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _layer_simple(arch: Arch) -> dict[str, str]:
    """Per-layer one-to-one renames (Megatron -> HF): the attention kind's, then the MoE block's."""
    return {**(_MLA_SIMPLE if _is_mla(arch) else _LAYER_SIMPLE), **_moe_simple(arch)}


def _moe_simple(arch: Arch) -> dict[str, str]:
    """Per-layer one-to-one renames of the MoE block (Megatron -> HF) under the family's module name."""
    moe = arch.moe_module
    out = {"mlp.router.weight": f"{moe}.gate.weight"}
    if arch.router_expert_bias:
        out[ROUTER_BIAS] = f"{moe}.gate.e_score_correction_bias"
    if arch.shared_expert_intermediate_size:
        out["mlp.shared_experts.linear_fc2.weight"] = f"{moe}.{arch.shared_expert_module}.down_proj.weight"
        if arch.shared_expert_gate:
            out["mlp.shared_experts.gate_weight"] = f"{moe}.shared_expert_gate.weight"
    return out


_TOP_SIMPLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def canonical_name(name: str) -> str:
    """Strip DDP/Float16 ``module.`` prefixes and map TE-spec names onto local-spec names.

    Returns ``""`` for entries that are not weights (``_extra_state``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    if name.endswith("_extra_state"):
        return ""
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{_TE_ALIASES[m.group(2)]}"
    return name


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def local_to_global_name(name: str, arch: Arch, layout: Layout) -> str:
    """Rank-local canonical Megatron name -> global name (layer += PP offset, expert += EP offset)."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = int(m.group(1)) + layout.layer_offset(arch.num_layers)
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + layout.expert_offset(arch.num_experts)}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


def global_to_local_name(name: str, arch: Arch, layout: Layout) -> str | None:
    """Global Megatron name -> this rank's local name, or None when another rank owns it."""
    m = _LAYER.match(name)
    if not m:
        if name.startswith("embedding.") and not layout.first_stage:
            return None
        if (name.startswith("output_layer.") or name.startswith("decoder.final_layernorm.")) and not layout.last_stage:
            return None
        return name
    per = layout.layers_per_stage(arch.num_layers)
    layer = int(m.group(1)) - layout.layer_offset(arch.num_layers)
    if not 0 <= layer < per:
        return None
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        expert = int(e.group(1)) - layout.expert_offset(arch.num_experts)
        if not 0 <= expert < layout.experts_per_rank(arch.num_experts):
            return None
        rest = f"mlp.experts.local_experts.{expert}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


# --------------------------------------------------------------------------- TP shards


def tp_kind(name: str) -> str:
    """How a canonical Megatron parameter is split over TP: vocab|column|glu|row|replicated."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith("self_attention.linear_qkv.weight") or name.endswith("self_attention.linear_qkv.bias"):
        return "column"
    if any(name.endswith(f"self_attention.{m}.weight") for m in _MLA_COLUMN):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith("linear_fc2.weight") or name.endswith("self_attention.linear_proj.weight"):
        return "row"
    return "replicated"


# MLA's projections are ColumnParallelLinear in Megatron's local spec, the down projections too
# (their output is gathered back to the full latent): each is split by output rows over TP
_MLA_COLUMN = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def shard_tp(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The TP shard of ``full`` held by TP rank ``rank`` (vocab rows must already be padded)."""
    kind = tp_kind(name)
    if tp == 1 or kind == "replicated":
        return full
    if kind in ("vocab", "column"):
        return full.chunk(tp, dim=0)[rank]
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard_tp` given the shards of all TP ranks in rank order."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind in ("vocab", "column"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


# --------------------------------------------------------------------------- HF <-> global


def _qkv_pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    """Q, K, V rows grouped per query group (weights ``[rows, hidden]`` or biases ``[rows]``)."""
    ng, hd, rest = arch.num_kv_heads, arch.head_dim, tuple(q.shape[1:])
    qpg = arch.num_heads // ng
    q = q.reshape(ng, qpg * hd, *rest)
    k = k.reshape(ng, hd, *rest)
    v = v.reshape(ng, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (qpg + 2) * hd, *rest)


def _qkv_unpack(qkv: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd, rest = arch.num_kv_heads, arch.head_dim, tuple(qkv.shape[1:])
    qpg = arch.num_heads // ng
    grouped = qkv.reshape(ng, (qpg + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [qpg * hd, hd, hd], dim=1)  # Tensor.split: the same, untyped in torch
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_per_expert(hf_sd: Mapping[str, torch.Tensor], arch: Arch | None = None) -> dict[str, torch.Tensor]:
    """Normalise fused in-memory expert tensors (transformers 5.x ``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) to the family's per-expert checkpoint layout
    (``arch``'s MoE module and projection names; Qwen's without ``arch``); other entries pass through."""
    moe = arch.moe_module if arch is not None else "mlp"
    gate_n, up_n, down_n = arch.expert_proj if arch is not None else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("mlp.experts.gate_up_proj")] + f"{moe}.experts."
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.{gate_n}.weight"] = gate
                out[f"{prefix}{e}.{up_n}.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("mlp.experts.down_proj")] + f"{moe}.experts."
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{down_n}.weight"] = t[e]
        else:
            out[name] = t
    return out


def hf_to_megatron_global(hf_sd: Mapping[str, torch.Tensor], arch: Arch, tp: int = 1) -> dict[str, torch.Tensor]:
    """HF state dict -> full Megatron tensors under global local-spec names.

    Vocab-parallel tensors are zero-padded to a multiple of ``tp`` rows. ``lm_head.weight`` may be
    absent for tied embeddings (the embedding is used)."""
    sd = hf_per_expert(hf_sd, arch)
    out: dict[str, torch.Tensor] = {}
    vocab = padded_vocab(arch.vocab_size, tp)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == vocab:
            return t
        return torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])], dim=0)

    out["embedding.word_embeddings.weight"] = pad(sd["model.embed_tokens.weight"])
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    lm_head = sd.get("lm_head.weight")
    if lm_head is None or arch.tie_word_embeddings:
        lm_head = sd["model.embed_tokens.weight"]
    out["output_layer.weight"] = pad(lm_head)
    hf_simple = {v: k for k, v in _layer_simple(arch).items()}
    gate_n, up_n, down_n = arch.expert_proj
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        g = f"decoder.layers.{layer}."
        if not _is_mla(arch):
            out[g + "self_attention.linear_qkv.weight"] = _qkv_pack(
                sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"],
                arch)
        if arch.qkv_bias:
            out[g + "self_attention.linear_qkv.bias"] = _qkv_pack(
                sd[p + "self_attn.q_proj.bias"], sd[p + "self_attn.k_proj.bias"], sd[p + "self_attn.v_proj.bias"], arch)
        for hf_suffix, mg_suffix in hf_simple.items():
            if p + hf_suffix in sd:
                out[g + mg_suffix] = sd[p + hf_suffix]
        if is_moe_layer(arch, layer):
            moe = f"{p}{arch.moe_module}."
            for e in range(arch.num_experts):
                ep = f"{moe}experts.{e}."
                eg = f"{g}mlp.experts.local_experts.{e}."
                out[eg + "linear_fc1.weight"] = torch.cat(
                    [sd[f"{ep}{gate_n}.weight"], sd[f"{ep}{up_n}.weight"]], dim=0)
                out[eg + "linear_fc2.weight"] = sd[f"{ep}{down_n}.weight"]
            if arch.shared_expert_intermediate_size:
                shared = f"{moe}{arch.shared_expert_module}."
                out[g + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [sd[shared + "gate_proj.weight"], sd[shared + "up_proj.weight"]], dim=0)
        else:
            out[g + "mlp.linear_fc1.weight"] = torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0)
    return out


def megatron_global_to_hf(name: str, tensor: torch.Tensor, arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """One full (TP-gathered) global canonical Megatron tensor -> its HF (name, tensor) pairs.

    Vocab padding is removed; ``output_layer.weight`` yields nothing for tied embeddings."""
    if name in _TOP_SIMPLE:
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return []
        if name != "decoder.final_layernorm.weight":
            tensor = tensor[: arch.vocab_size]
        return [(_TOP_SIMPLE[name], tensor)]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    p = f"model.layers.{m.group(1)}."
    rest = m.group(2)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = _qkv_unpack(tensor, arch)
        return [(p + f"self_attn.q_proj.{kind}", q), (p + f"self_attn.k_proj.{kind}", k),
                (p + f"self_attn.v_proj.{kind}", v)]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    moe = f"{p}{arch.moe_module}."
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        shared = f"{moe}{arch.shared_expert_module}."
        return [(shared + "gate_proj.weight", gate), (shared + "up_proj.weight", up)]
    e = _EXPERT.match(rest)
    if e:
        ep = f"{moe}experts.{e.group(1)}."
        gate_n, up_n, down_n = arch.expert_proj
        if e.group(2) == "linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{ep}{gate_n}.weight", gate), (f"{ep}{up_n}.weight", up)]
        if e.group(2) == "linear_fc2.weight":
            return [(f"{ep}{down_n}.weight", tensor)]
    simple = _layer_simple(arch)
    if rest in simple:
        return [(p + simple[rest], tensor)]
    raise KeyError(f"no HF name for Megatron parameter {name!r}")


# --------------------------------------------------------------------------- composed


def hf_state_dict_to_megatron(hf_sd: Mapping[str, torch.Tensor], arch: Arch, layout: Layout) -> dict[str, torch.Tensor]:
    """HF state dict -> this rank's canonical local Megatron tensors (PP/EP selected, TP sharded)."""
    out: dict[str, torch.Tensor] = {}
    for gname, full in hf_to_megatron_global(hf_sd, arch, layout.tp).items():
        lname = global_to_local_name(gname, arch, layout)
        if lname is None:
            continue
        if lname == "output_layer.weight" and arch.tie_word_embeddings and layout.pp == 1:
            continue  # shares the embedding parameter
        if is_expert_param(lname):
            out[lname] = shard_tp(lname, full, layout.expert_tp, layout.expert_tp_rank).contiguous()
        else:
            out[lname] = shard_tp(lname, full, layout.tp, layout.tp_rank).contiguous()
    return out


def megatron_to_hf(megatron_global_sd: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                   arch: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """Full global Megatron tensors (any spec, ``module.`` prefixes allowed) -> HF (name, tensor)."""
    items = megatron_global_sd.items() if isinstance(megatron_global_sd, Mapping) else megatron_global_sd
    for name, tensor in items:
        cname = canonical_name(name)
        if cname:
            yield from megatron_global_to_hf(cname, tensor, arch)


_QKV_A = re.compile(r"^(model\.layers\.\d+\.self_attn\.)(q_a_proj|kv_a_proj_with_mqa)\.weight$")


def load_together(name: str) -> str | None:
    """A key shared by the HF tensors an engine loads only when one ``load_weights`` call gets them
    all, None for a tensor that loads alone.

    SGLang 0.5.23 fuses MLA's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one parameter
    (``fused_qkv_a_proj_with_mqa``, ``deepseek_weight_loader.py``): it keeps the first of the pair
    until the second arrives in the same call and, with the pair split over two calls (two buckets
    of ``/update_weights_from_distributed``), loads neither, without a word. The push planner
    (:func:`dora_megatron.weights.plan.plan_buckets`) keeps tensors with one key in one bucket;
    :func:`hf_names` lists them next to each other."""
    m = _QKV_A.match(name)
    return f"{m.group(1)}q_a_proj+kv_a_proj_with_mqa" if m else None


def hf_export(megatron_global_sd: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
              arch: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's HF (name, tensor) pairs in :func:`hf_names` order, from its gathered global
    Megatron tensors: what an export, a snapshot and a weight push send (KeyError naming a weight
    the tensors do not give)."""
    hf = dict(megatron_to_hf(megatron_global_sd, arch))
    for name in hf_names(arch):
        yield name, hf[name]


def hf_names(arch: Arch) -> list[str]:
    """Every HF name the model has, per-expert layout, in a deterministic order."""
    names = ["model.embed_tokens.weight"]
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        names.append(p + "input_layernorm.weight")
        if _is_mla(arch):  # q_a_proj next to kv_a_proj_with_mqa: they load together (load_together)
            q = ["q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj"] if arch.q_lora_rank else \
                ["q_proj", "kv_a_proj_with_mqa"]
            names += [f"{p}self_attn.{m}.weight" for m in (*q, "kv_a_layernorm", "kv_b_proj", "o_proj")]
        else:
            names += [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                      p + "self_attn.v_proj.weight", p + "self_attn.o_proj.weight"]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names.append(p + "post_attention_layernorm.weight")
        if is_moe_layer(arch, layer):
            moe = f"{p}{arch.moe_module}."
            names.append(moe + "gate.weight")
            if arch.router_expert_bias:
                names.append(moe + "gate.e_score_correction_bias")
            for e in range(arch.num_experts):
                names += [f"{moe}experts.{e}.{k}.weight" for k in arch.expert_proj]
            if arch.shared_expert_intermediate_size:
                names += [f"{moe}{arch.shared_expert_module}.{k}_proj.weight" for k in ("gate", "up", "down")]
                if arch.shared_expert_gate:
                    names.append(moe + "shared_expert_gate.weight")
        else:
            names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
