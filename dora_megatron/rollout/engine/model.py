"""The supported families' forward pass (Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3)
in plain torch, with parameters named as in HF.

Why our own model instead of transformers: the engine needs a ragged batch (prefill and decode
of many requests of different lengths in one forward, no padding) over per-request KV caches
that can be exported. The parameter names equal the Hugging Face checkpoint names, so loading,
weight updates (HF names over the wire) and checksums need no renaming. Numerics follow
transformers' implementation (RMSNorm in fp32, RoPE with rotate-half, QK-norm before RoPE, GQA,
SwiGLU, softmax router over all experts then top-k, renormalised when ``norm_topk_prob``, a shared
expert behind a sigmoid gate; GLM-4.5's partial rotary and biased, grouped sigmoid router in fp32).
What differs between families (QK-norm, q/k/v biases, the MoE module's and experts' names, the
shared expert, rotary share, router kind) is read from the ``ModelSpec``, which the family's row in
:mod:`dora_megatron.models.families` fills. The architecture comes from
:func:`dora_megatron.models.hf_config.read_spec`, the one ``config.json`` reader (transformers'
config classes) that the trainer and the converter use too.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dora_megatron.models import hf_config, hf_model_dir
from dora_megatron.models.hf_config import ModelSpec
from dora_megatron.rollout.engine.kv_cache import KVShape, RequestKV

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[n, heads, head_dim]``: its first ``cos.shape[-1]`` dims rotated (all of them,
    or the leading part with a partial rotary factor, as transformers' GLM-4.5), the rest unchanged."""
    rd = cos.shape[-1]
    cos_, sin_ = cos[:, None, :], sin[:, None, :]
    if rd == x.shape[-1]:
        return x * cos_ + rotate_half(x) * sin_
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos_ + rotate_half(rot) * sin_, rest), dim=-1)


def rope_inv_freq(c: ModelSpec) -> torch.Tensor:
    """Default RoPE frequencies over the rotated dims (``rotary_dim``, or the whole head)."""
    dim = c.rotary_dim or c.head_dim
    return 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class Segment(NamedTuple):
    """One request's part of a ragged forward: its cache, its ``m`` new tokens, and how they attend
    (``mask``, added to the scores, over the cache's earlier tokens and the new ones, or
    ``causal``; neither: one token attending to everything). WHY computed once per forward
    (:func:`segment_of`): every layer of a draft's verify pass would otherwise build the same mask
    again."""

    kv: RequestKV
    m: int
    mask: torch.Tensor | None
    causal: bool


def segment_of(kv: RequestKV, m: int, device: torch.device) -> Segment:
    """The :class:`Segment` of ``m`` new tokens after the ``kv.length`` tokens ``kv`` holds: a lone
    token attends to all of them, a prefill from empty is plainly causal, and new tokens after
    earlier ones (a draft's verify positions, a chunked prefill) attend to the past and causally
    among themselves."""
    past = kv.length
    if m == 1:
        return Segment(kv, m, None, False)
    if past == 0:
        return Segment(kv, m, None, True)
    rows = torch.arange(m, device=device)[:, None] + past
    visible = torch.arange(past + m, device=device)[None, :] <= rows
    # additive, in the cache's dtype: attention would otherwise convert a boolean mask in every layer
    mask = torch.zeros(visible.shape, dtype=kv.shape.dtype, device=device).masked_fill_(~visible, float("-inf"))
    return Segment(kv, m, mask, False)


class Attention(nn.Module):
    def __init__(self, c: ModelSpec) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        segments: Sequence[Segment],
    ) -> torch.Tensor:
        c = self.c
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(n, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, n, d]
        out = torch.empty((c.num_heads, n, c.head_dim), dtype=x.dtype, device=x.device)
        start = 0
        scale = c.head_dim**-0.5
        for kv, m, mask, causal in segments:
            k_all, v_all = kv.write(layer, k[:, start : start + m], v[:, start : start + m])
            qs = q[:, start : start + m]
            o = F.scaled_dot_product_attention(
                qs[None], k_all[None], v_all[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
            out[:, start : start + m] = o[0]
            start += m
        return self.o_proj(out.transpose(0, 1).reshape(n, c.num_heads * c.head_dim))


def mla_cache_width(c: ModelSpec) -> int:
    """Width of one of the two halves an MLA layer's latent cache row is stored in (see
    :class:`LatentAttention`)."""
    return -(-(c.kv_lora_rank + c.qk_rope_head_dim) // 2)


def yarn_mscale_all_dim(c: ModelSpec) -> float:
    """YaRN's ``mscale_all_dim`` factor, which DeepSeek's MLA applies (squared) to the softmax scale
    of every dimension, rotary or not (transformers' ``yarn_apply_mscale``); 1 without YaRN."""
    rope = dict(c.rope_parameters)
    factor, m = float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim", 0) or 0)
    if c.rope_type != "yarn" or not m or factor <= 1:
        return 1.0
    return 0.1 * m * math.log(factor) + 1.0


class LatentAttention(nn.Module):
    """DeepSeek's multi-latent attention, caching the latent: per token and layer only the
    normalised kv latent (``kv_lora_rank``) and the rotated shared rotary key (``qk_rope_head_dim``),
    not per-head keys and values. The cache row ``[latent | k_rot]`` is stored split in two halves
    in the request's k and v tensors (one "head" of :func:`mla_cache_width` each, the odd width
    zero-padded), so export, prefix copies and truncation work on it unchanged. Each step expands
    the cached latents with ``kv_b_proj`` (no weight absorption). Numerics follow transformers'
    ``DeepseekV3Attention`` (interleaved RoPE on the rotary part, latent norms with eps 1e-6)."""

    def __init__(self, c: ModelSpec) -> None:
        super().__init__()
        self.c = c
        h, nh = c.hidden_size, c.num_heads
        self.q_head = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)  # transformers' default eps for the latents
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * self.q_head, bias=False)
        else:
            self.q_proj = nn.Linear(h, nh * self.q_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=False)
        self.scale = self.q_head ** -0.5 * yarn_mscale_all_dim(c) ** 2

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs (x0, x1), (x2, x3), ... rotated; output de-interleaved, as transformers."""
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x * cos + rotate_half(x) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                segments: Sequence[Segment]) -> torch.Tensor:
        c = self.c
        n, nh, nope, rope = x.shape[0], c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q_nope, q_rot = q.view(n, nh, self.q_head).split([nope, rope], dim=-1)
        q = torch.cat((q_nope, self._rope(q_rot, cos[:, None, :], sin[:, None, :])), dim=-1).transpose(0, 1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        row = torch.cat((self.kv_a_layernorm(latent), self._rope(k_rot, cos, sin)), dim=-1)
        half = mla_cache_width(c)
        row = F.pad(row, (0, 2 * half - row.shape[-1]))[None]  # [1, n, 2 * half]
        out = torch.empty((nh, n, c.v_head_dim), dtype=x.dtype, device=x.device)
        start = 0
        for kv, m, mask, causal in segments:
            first, second = kv.write(layer, row[:, start:start + m, :half], row[:, start:start + m, half:])
            cached = torch.cat((first[0], second[0]), dim=-1)  # [t, 2 * half]
            t = cached.shape[0]
            k_nope, v = self.kv_b_proj(cached[:, :c.kv_lora_rank]).view(t, nh, nope + c.v_head_dim).split(
                [nope, c.v_head_dim], dim=-1)
            k_rope = cached[:, c.kv_lora_rank:c.kv_lora_rank + rope][:, None, :].expand(t, nh, rope)
            k = torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[None, :, start:start + m], k[None], v.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=causal, scale=self.scale)
            out[:, start:start + m] = o[0]
            start += m
        return self.o_proj(out.transpose(0, 1).reshape(n, nh * c.v_head_dim))


_QWEN_PROJ = ("gate_proj", "up_proj", "down_proj")


class MLP(nn.Module):
    """SwiGLU; ``names``: the HF module names of its gate, up and down projections (Mixtral's
    experts call them ``w1``, ``w3``, ``w2``)."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str] = _QWEN_PROJ) -> None:
        super().__init__()
        self.names = names
        for name, shape in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            self.add_module(name, nn.Linear(*shape, bias=False))

    @property
    def gate(self) -> nn.Linear:
        return getattr(self, self.names[0])

    @property
    def up(self) -> nn.Linear:
        return getattr(self, self.names[1])

    @property
    def down(self) -> nn.Linear:
        return getattr(self, self.names[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


#: A MoE layer computes every expert on its tokens in two matmuls when that takes at most this many
#: multiply-adds, else it runs only each token's top-k experts, one expert at a time.
#: WHY: a decode or verify step of a small batch of a small model (a lone tail request and its
#: draft, on CPU) is bound by per-operation overhead, not arithmetic: the per-expert path issues
#: ~10 small operations per expert hit, and a verify step of k+1 positions hits up to k+1 times as
#: many experts as a decode step. All experts at once costs num_experts / top_k times the
#: arithmetic in a fixed handful of operations; the bound keeps that to a fraction of a
#: millisecond on one core (``tools/bench_speculative.py`` reports the step costs), so a real
#: model's layer (millions of multiply-adds per expert) always takes the per-expert path. The
#: stacked copy of the experts' weights it reads doubles their memory in this engine.
DENSE_EXPERT_MACS = 1 << 22


def sigmoid_topk(c: ModelSpec, logits: torch.Tensor, bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing (transformers' ``Glm4MoeTopkRouter``), fp32 ``logits`` [n, E]:
    sigmoid scores; the experts chosen on scores + correction bias, only within the ``router_group_topk``
    groups (of ``router_groups``) whose two best biased scores sum highest; weighted by the unbiased
    scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if c.router_groups > 1:
        n = choice.shape[0]
        grouped = choice.view(n, c.router_groups, -1)
        group_idx = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(c.router_group_topk, dim=-1, sorted=False)[1]
        keep = torch.zeros((n, c.router_groups), dtype=torch.bool, device=choice.device).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(n, -1), float("-inf"))
    top_i = torch.topk(choice, c.top_k, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if c.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * c.routed_scaling_factor, top_i


class SparseMoE(nn.Module):
    """Router (``gate``) + routed experts (``experts.E``) + the family's shared expert
    (``shared_expert``, scaled by ``sigmoid(shared_expert_gate(x))`` when the family gates it)."""

    def __init__(self, c: ModelSpec) -> None:
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(c.hidden_size, c.moe_intermediate_size, c.expert_proj)
                                      for _ in range(c.num_experts)])
        if c.router_expert_bias:  # HF ``gate.e_score_correction_bias``: a weight of the checkpoint
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        # the family's module name (GLM: ``shared_experts``)
        self.shared_name = c.shared_expert_module
        self.add_module(self.shared_name, MLP(c.hidden_size, c.shared_expert_intermediate_size)
                        if c.shared_expert_intermediate_size else None)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False) if c.shared_expert_gate else None
        #: the most tokens a forward computes with every expert at once (see DENSE_EXPERT_MACS)
        self.all_experts_max_tokens = DENSE_EXPERT_MACS // (c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size)
        self._stacked: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
        self._expert_params = self._find_expert_params()

    def _find_expert_params(self) -> list[nn.Parameter]:
        return [p for ex in self.experts for p in (ex.gate.weight, ex.up.weight, ex.down.weight)]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Every move or dtype change (``to``, ``to_empty``, ...) runs through here and may replace
        the Parameter objects (``to_empty`` from the meta device does): look them up again."""
        out = super()._apply(fn, recurse)
        if self.c.router == "sigmoid" and self.gate.weight.dtype != torch.float32:
            # the sigmoid router's weight and correction bias stay fp32 whatever the model's dtype, as
            # transformers keeps them (hf_config.keeps_fp32): in bf16 they would pick other experts
            # where biased scores are close
            self.gate.weight.data = self.gate.weight.data.float()
            if self.c.router_expert_bias:
                self.gate.e_score_correction_bias = self.gate.e_score_correction_bias.float()
        self._expert_params = self._find_expert_params()
        self._stacked = None
        return out

    def forward(self, x: torch.Tensor, routing_out: dict[int, torch.Tensor] | None = None, layer: int = 0
                ) -> torch.Tensor:
        routed = self._routed(x, routing_out, layer)
        shared_expert = getattr(self, self.shared_name)
        if shared_expert is None:
            return routed
        shared = shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def _routed(self, x: torch.Tensor, routing_out: dict[int, torch.Tensor] | None, layer: int) -> torch.Tensor:
        if self.c.router == "sigmoid":
            bias = self.gate.e_score_correction_bias.float() if self.c.router_expert_bias else None
            top_w, top_i = sigmoid_topk(self.c, F.linear(x.float(), self.gate.weight.float()), bias)
        else:
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
            top_w, top_i = torch.topk(probs, self.c.top_k, dim=-1)
            if self.c.norm_topk_prob:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if routing_out is not None:  # routing replay: the top-k experts of every token, as used
            routing_out[layer] = top_i.to(torch.int32)
        top_w = top_w.to(x.dtype)
        if x.shape[0] <= self.all_experts_max_tokens:
            return self._all_experts(x, top_w, top_i)
        out = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            y = self.experts[e](x[tok]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y)
        return out

    def _all_experts(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, each weighted by its routing weight (0 off the top-k): the
        same sum as the per-expert path, since an expert outside a token's top-k adds exactly 0.
        The weight scales the activation before the down projection (a linear map, so the same
        value up to rounding)."""
        n, ff = x.shape[0], self.c.moe_intermediate_size
        gate_up, down = self._stacked_weights()
        h = F.linear(x, gate_up).view(n, self.c.num_experts, 2, ff)
        w = torch.zeros((n, self.c.num_experts), dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w)
        act = F.silu(h[:, :, 0]) * h[:, :, 1] * w[:, :, None]
        return F.linear(act.reshape(n, -1), down)

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights side by side (``[E * 2 * ff, hidden]`` gate and up, ``[hidden,
        E * ff]`` down), rebuilt whenever a parameter changed. WHY key on the parameters' version
        counters: every in-place write (a weight push's ``copy_``, a test's edit) bumps them, so a
        stale copy can never be used, whoever wrote the weights."""
        params = self._expert_params
        key = tuple([p._version for p in params] + [p.data_ptr() for p in params])
        if self._stacked is None or self._stacked[0] != key:
            gate_up = torch.cat([torch.cat((ex.gate.weight, ex.up.weight)) for ex in self.experts])
            down = torch.cat([ex.down.weight for ex in self.experts], dim=1)
            self._stacked = (key, gate_up, down)
        return self._stacked[1], self._stacked[2]


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelSpec, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.self_attn = LatentAttention(c) if c.is_mla else Attention(c)
        # the MoE block's HF module name is the family's (Mixtral: ``block_sparse_moe``)
        self.ffn_name = c.moe_module if idx in c.sparse_layers else "mlp"
        self.add_module(self.ffn_name, SparseMoE(c) if idx in c.sparse_layers else MLP(c.hidden_size, c.intermediate_size))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x, cos, sin, segments, routing_out=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, self.idx, segments)
        h = self.post_attention_layernorm(x)
        ffn = self.ffn
        if isinstance(ffn, SparseMoE):
            return x + ffn(h, routing_out, self.idx)
        return x + ffn(h)


class _Backbone(nn.Module):
    def __init__(self, c: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c, i) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    """Causal LM of a supported family; ``state_dict()`` keys are the HF checkpoint names."""

    def __init__(self, c: ModelSpec) -> None:
        super().__init__()
        self.config = c
        self.model = _Backbone(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)
        #: cos and sin are multiplied by it (YaRN's attention factor; 1 for the default RoPE)
        self.attention_scaling = 1.0

    # ---- weights -------------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    def check_weights(self, tensors: Mapping[str, torch.Tensor], require_all: bool) -> list[str]:
        """Problems (unknown names, wrong shapes, missing names) as readable strings."""
        expected = self.expected_shapes()
        problems = []
        for name, t in tensors.items():
            if name not in expected:
                problems.append(f"unknown weight name {name!r}")
            elif tuple(t.shape) != expected[name]:
                problems.append(f"{name}: shape {list(t.shape)} != expected {list(expected[name])}")
        if require_all:
            missing = sorted(set(expected) - set(tensors))
            if missing:
                shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                problems.append(f"missing {len(missing)} weights: {shown}")
        return problems

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor], require_all: bool = False) -> None:
        """Copy HF-named tensors into the parameters; all-or-nothing (validated first)."""
        problems = self.check_weights(tensors, require_all)
        if problems:
            raise ValueError("; ".join(problems))
        params = self.state_dict()
        for name, t in tensors.items():
            params[name].copy_(t.to(params[name].dtype))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    # ---- forward -------------------------------------------------------------------------
    def forward_segments(
        self, token_ids: torch.Tensor, positions: torch.Tensor, segments: Sequence[tuple[RequestKV, int]],
        routing_out: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Ragged forward: ``token_ids`` is the concatenation of each segment's new tokens.

        Each segment ``(kv, m)`` appends ``m`` tokens to request ``kv`` (whose cache must hold
        ``kv.length`` earlier tokens and have capacity for ``m`` more). Returns the final hidden
        states ``[N, hidden]`` (after the last norm); caches are advanced by ``m``. With
        ``routing_out`` (a dict), each MoE layer ``i`` stores its top-k expert ids ``[N, top_k]``
        (int32) under key ``i``.
        """
        x = self.model.embed_tokens(token_ids)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)
        planned = [segment_of(kv, m, x.device) for kv, m in segments]
        for layer in self.model.layers:
            x = layer(x, cos, sin, planned, routing_out)
        for kv, m in segments:
            kv.commit(m)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w)

    def kv_shape(self, block_size: int) -> KVShape:
        p = self.model.embed_tokens.weight
        c = self.config
        if c.is_mla:  # the latent cache: one row [latent | k_rot] per token, in two halves (LatentAttention)
            return KVShape(c.num_layers, 1, mla_cache_width(c), block_size, p.dtype, p.device)
        return KVShape(c.num_layers, c.num_kv_heads, c.head_dim, block_size, p.dtype, p.device)


def load_model(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build :class:`CausalLM` from an HF directory (config.json + safetensors)."""
    cfg = hf_config.read_spec(model_dir)
    problems = cfg.engine_problems()
    if problems:
        raise ValueError(f"{model_dir}/{hf_config.CONFIG_FILE}: " + "; ".join(problems))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.rope_type == "default":
        inv = rope_inv_freq(cfg)
    else:  # a scaled RoPE (YaRN, linear, llama3): transformers' own frequencies and attention factor
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_cfg = hf_config.transformers_config(hf_config.read_json(model_dir), f"{model_dir}/{hf_config.CONFIG_FILE}")
        inv, model.attention_scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_cfg, torch.device("cpu"))
    model.inv_freq = inv.float().to(device)
    state = hf_model_dir.load_state_dict(model_dir)
    skipped = hf_config.mtp_names(state, cfg.num_layers)
    if skipped:
        logger.info("skipping %d tensors of multi-token-prediction layers (num_nextn_predict_layers=%d): the engine "
                    "decodes one token per step", len(skipped), cfg.mtp_layers)
        for name in skipped:
            del state[name]
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_weights(state, require_all=True)
    model.eval()
    return model
