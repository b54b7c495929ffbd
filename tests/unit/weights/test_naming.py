"""Megatron <-> HF naming: layouts checked against hand-built tensors, and round trips per rank."""

import pytest
import torch

from dora_megatron.weights import naming
from dora_megatron.weights.naming import Layout, NamingArch

ARCH = NamingArch(vocab_size=10, hidden_size=4, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=2,
                  num_experts=4)
DENSE = NamingArch(vocab_size=10, hidden_size=4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2)


def _hf_sd(arch, ffn=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h, hd = arch.hidden_size, arch.head_dim
    sd = {"model.embed_tokens.weight": r(arch.vocab_size, h), "model.norm.weight": r(h),
          "lm_head.weight": r(arch.vocab_size, h)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        sd.update({p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
                   p + "self_attn.q_proj.weight": r(arch.num_heads * hd, h),
                   p + "self_attn.k_proj.weight": r(arch.num_kv_heads * hd, h),
                   p + "self_attn.v_proj.weight": r(arch.num_kv_heads * hd, h),
                   p + "self_attn.o_proj.weight": r(h, arch.num_heads * hd),
                   p + "self_attn.q_norm.weight": r(hd), p + "self_attn.k_norm.weight": r(hd)})
        if arch.num_experts:
            sd[p + "mlp.gate.weight"] = r(arch.num_experts, h)
            for e in range(arch.num_experts):
                sd.update({f"{p}mlp.experts.{e}.gate_proj.weight": r(ffn, h),
                           f"{p}mlp.experts.{e}.up_proj.weight": r(ffn, h),
                           f"{p}mlp.experts.{e}.down_proj.weight": r(h, ffn)})
        else:
            sd.update({p + "mlp.gate_proj.weight": r(ffn, h), p + "mlp.up_proj.weight": r(ffn, h),
                       p + "mlp.down_proj.weight": r(h, ffn)})
    return sd


def test_qkv_rows_grouped_per_query_group():
    sd = _hf_sd(DENSE)
    qkv = naming.hf_to_megatron_global(sd, DENSE)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    # 2 query groups, 2 q heads per group, head_dim 2: group g = q heads 2g, 2g+1, then k_g, v_g
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(qkv, expected)


def test_fc1_is_gate_then_up_and_names():
    sd = _hf_sd(DENSE)
    g = naming.hf_to_megatron_global(sd, DENSE)
    fc1 = g["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(g["decoder.layers.1.pre_mlp_layernorm.weight"], sd["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(g["output_layer.weight"], sd["lm_head.weight"])


def test_round_trip_global_moe():
    sd = _hf_sd(ARCH)
    back = dict(naming.megatron_to_hf(naming.hf_to_megatron_global(sd, ARCH), ARCH))
    assert set(back) == set(sd) == set(naming.hf_names(ARCH))
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 4)])
def test_shard_and_gather_per_rank_round_trip(tp, pp, ep):
    sd = _hf_sd(ARCH)
    collected: dict[str, list] = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                layout = Layout(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
                local = naming.hf_state_dict_to_megatron(sd, ARCH, layout)
                for name, t in local.items():
                    g = naming.local_to_global_name(name, ARCH, layout)
                    assert naming.global_to_local_name(g, ARCH, layout) == name
                    collected.setdefault(g, [None] * tp)[tp_rank] = t
    full = {}
    for g, shards in collected.items():
        full[g] = naming.merge_tp(g, shards)
    back = dict(naming.megatron_to_hf(full, ARCH))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_local_names_use_stage_and_expert_offsets():
    layout = Layout(pp=2, pp_rank=1, ep=2, ep_rank=1)
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert naming.local_to_global_name(name, ARCH, layout) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    assert naming.global_to_local_name("decoder.layers.1.input_layernorm.weight", ARCH, layout) is None
    assert naming.global_to_local_name("embedding.word_embeddings.weight", ARCH, layout) is None
    assert naming.global_to_local_name("output_layer.weight", ARCH, layout) == "output_layer.weight"


def test_tp_shards_glu_halves_and_pads_vocab():
    full = torch.arange(8.0).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    assert naming.shard_tp("decoder.layers.0.mlp.linear_fc1.weight", full, 2, 1).flatten().tolist() == [2, 3, 6, 7]
    assert naming.padded_vocab(10, 4) == 12
    g = naming.hf_to_megatron_global(_hf_sd(ARCH), ARCH, tp=4)
    assert g["embedding.word_embeddings.weight"].shape[0] == 12
    assert not g["embedding.word_embeddings.weight"][10:].any()
    back = dict(naming.megatron_global_to_hf("output_layer.weight", g["output_layer.weight"], ARCH))
    assert back["lm_head.weight"].shape[0] == 10


def test_te_names_and_prefixes_are_canonicalised():
    assert naming.canonical_name("module.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert naming.canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert naming.canonical_name("decoder.layers.0.self_attention.linear_proj._extra_state") == ""


def test_fused_hf_expert_tensors_are_split():
    gate_up = torch.randn(3, 8, 4)
    down = torch.randn(3, 4, 4)
    out = naming.hf_per_expert({"model.layers.0.mlp.experts.gate_up_proj": gate_up,
                                "model.layers.0.mlp.experts.down_proj": down})
    assert torch.equal(out["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :4])
    assert torch.equal(out["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, 4:])
    assert torch.equal(out["model.layers.0.mlp.experts.1.down_proj.weight"], down[1])


def test_tied_embeddings_export_no_lm_head():
    tied = NamingArch(**{**DENSE.__dict__, "tie_word_embeddings": True})
    sd = _hf_sd(tied)
    del sd["lm_head.weight"]
    g = naming.hf_to_megatron_global(sd, tied)
    assert torch.equal(g["output_layer.weight"], sd["model.embed_tokens.weight"])
    assert "lm_head.weight" not in dict(naming.megatron_to_hf(g, tied))
    assert "output_layer.weight" not in naming.hf_state_dict_to_megatron(sd, tied, Layout())


def _family_spec(model_type: str, **extra):
    from dora_megatron.models.hf_config import spec_from_dict

    cfg = {"model_type": model_type, "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2, "intermediate_size": 12,
           "num_experts_per_tok": 2, "rope_theta": 1e4, **extra}
    return spec_from_dict(cfg)


FAMILY_SPECS = {
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=6, shared_expert_intermediate_size=10),
    "mixtral": dict(num_local_experts=4),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=6, mlp_only_layers=[0, 2]),
    "glm4_moe": dict(n_routed_experts=4, moe_intermediate_size=6, n_shared_experts=1, first_k_dense_replace=1,
                     attention_bias=True, use_qk_norm=True, n_group=2, topk_group=1),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=6, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2,
                        qk_rope_head_dim=2, v_head_dim=3, num_key_value_heads=4),
}


@pytest.mark.parametrize("family", sorted(FAMILY_SPECS))
@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 2), (2, 2, 2)])
def test_each_familys_hf_names_round_trip_through_rank_shards(family, tp, pp, ep):
    """Qwen2-MoE's q/k/v biases (grouped with the weights, TP-sharded) and gated shared expert,
    Mixtral's block_sparse_moe.experts.E.w1/w3/w2, a Qwen3-MoE's dense layers, GLM-4.5's
    shared_experts and e_score_correction_bias after its dense first layer: every HF tensor the
    family has comes back bit-exact from the ranks' Megatron shards."""
    spec = _family_spec(family, **FAMILY_SPECS[family])
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(s, generator=g) for k, s in spec.expected_shapes().items()}
    assert set(sd) == set(naming.hf_names(spec))
    collected: dict[str, list] = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                layout = Layout(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank)
                for name, t in naming.hf_state_dict_to_megatron(sd, spec, layout).items():
                    collected.setdefault(naming.local_to_global_name(name, spec, layout), [None] * tp)[tp_rank] = t
    back = dict(naming.megatron_to_hf({k: naming.merge_tp(k, v) for k, v in collected.items()}, spec))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    names = " ".join(collected)
    if family == "qwen2_moe":
        assert "linear_qkv.bias" in names and "shared_experts.gate_weight" in names
    if family == "mixtral":
        assert "model.layers.3.block_sparse_moe.experts.3.w3.weight" in sd
    if family == "deepseek_v3":
        assert "decoder.layers.1.mlp.router.expert_bias" in names and "linear_kv_down_proj" in names
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in sd and "decoder.layers.0.mlp.linear_fc1" in names
    if family == "qwen3_moe":
        assert "decoder.layers.0.mlp.linear_fc1.weight" in names and "decoder.layers.1.mlp.router.weight" in names
    if family == "glm4_moe":  # the correction bias travels as Megatron's router buffer
        assert "decoder.layers.1.mlp.router.expert_bias" in names and "decoder.layers.0.mlp.linear_fc1.weight" in names
        assert "model.layers.3.mlp.shared_experts.up_proj.weight" in sd and "linear_qkv.bias" in names


def test_a_deepseek_push_keeps_each_layers_q_a_and_kv_a_projections_in_one_bucket():
    """SGLang fuses q_a_proj and kv_a_proj_with_mqa and loads the pair only from one call: at the
    smallest bucket size every other tensor travels alone and each layer's pair together."""
    from dora_megatron.weights.distributed import push_buckets
    from dora_megatron.weights.plan import plan_buckets

    spec = _family_spec("deepseek_v3", **FAMILY_SPECS["deepseek_v3"])
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g) for k, s in spec.expected_shapes().items()}
    pushed = list(naming.hf_export(naming.hf_to_megatron_global(sd, spec), spec))
    assert [n for n, _ in pushed] == naming.hf_names(spec)
    buckets = push_buckets(dict(pushed), 1e-9)
    together = [b.names for b in buckets if len(b.names) > 1]
    assert together == [[f"model.layers.{i}.self_attn.q_a_proj.weight", f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
                        for i in range(spec.num_layers)]
    assert len(buckets) == len(pushed) - spec.num_layers
    no_q_lora = _family_spec("deepseek_v3", **{**FAMILY_SPECS["deepseek_v3"], "q_lora_rank": None})
    names = naming.hf_names(no_q_lora)
    assert all(len(b.names) == 1 for b in plan_buckets([(n, "float32", (1,)) for n in names], 1e-9, naming.load_together))


@pytest.mark.parametrize("layers,vpp,field,count", [(3, 1, "num_layers_in_first_pipeline_stage", 1),
                                                    (6, 2, "num_layers_in_last_pipeline_stage", 2)])
def test_an_uneven_split_pushes_every_hf_name_once(layers, vpp, field, count):
    """DeepSeek-V3 (a dense first layer) on 2 pipeline ranks split unevenly by Megatron's own rule
    (``trainer.pipeline_split``): each rank's chunks load only their layers, their global names
    meet no other chunk's, and the push's buckets carry every HF name exactly once, bit-exact."""
    from collections import Counter

    from dora_megatron.config.trainer import TrainerConfig
    from dora_megatron.trainer.pipeline_split import trainer_split
    from dora_megatron.weights.distributed import push_buckets

    spec = _family_spec("deepseek_v3", **{**FAMILY_SPECS["deepseek_v3"], "num_hidden_layers": layers})
    split = trainer_split(spec, TrainerConfig(pp=2, vpp=vpp, megatron={field: count}))
    g = torch.Generator().manual_seed(2)
    sd = {k: torch.randn(s, generator=g) for k, s in spec.expected_shapes().items()}
    owners: Counter = Counter()
    merged: dict[str, torch.Tensor] = {}
    for pp_rank in range(2):
        rank = Layout(pp=2, pp_rank=pp_rank, vpp=vpp, chunk_layers=split.rank(pp_rank))
        for v in range(vpp):
            chunk = rank.chunk(v)
            local = naming.hf_state_dict_to_megatron(sd, spec, chunk)
            layers_here = {int(n.split(".")[2]) for n in local if n.startswith("decoder.layers.")}
            assert layers_here == set(range(chunk.layers_per_stage(layers))), (pp_rank, v)
            for name, t in local.items():
                global_name = naming.local_to_global_name(name, spec, chunk)
                owners[global_name] += 1
                merged[global_name] = t
    assert max(owners.values()) == 1  # no two chunks hold the same layer
    pushed = [name for bucket in push_buckets(dict(naming.hf_export(merged, spec)), 1e-9) for name in bucket.names]
    assert sorted(pushed) == sorted(naming.hf_names(spec)) == sorted(sd)
    for name, t in naming.hf_export(merged, spec):
        assert torch.equal(t, sd[name]), name
