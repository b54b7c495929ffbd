"""Our forward pass equals transformers' Qwen3 / Qwen3-MoE on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from dora_megatron.models import hf_model_dir
from dora_megatron.rollout.engine.kv_cache import RequestKV
from dora_megatron.rollout.engine.model import load_model
from tests.helpers.engine_logits import full_logits

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("which,cls", [("moe_dir", "Qwen3MoeForCausalLM"), ("dense_dir", "Qwen3ForCausalLM")])
def test_logits_match_transformers(request, which, cls):
    model_dir = request.getfixturevalue(which)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(hf).__name__ == cls
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    ours = load_model(model_dir)
    ids = torch.randint(3, 98, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = full_logits(ours, ids)
    assert ref.std() > 0.5  # the layers matter, not just embedding -> head
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _moe_layers(model):
    from dora_megatron.rollout.engine.model import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_all_experts_path_matches_transformers_and_follows_weight_updates(moe_dir):
    """A short sequence takes the all-experts MoE path (a long one, above, the per-expert path);
    after a weight update it must compute with the new expert weights, not a stale stacked copy."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ours = load_model(moe_dir)
    ids = list(range(7, 17))
    assert all(len(ids) <= m.all_experts_max_tokens for m in _moe_layers(ours))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    before = full_logits(ours, ids)
    torch.testing.assert_close(before, ref, rtol=1e-5, atol=1e-5)
    ours.load_weights({k: -1.5 * v for k, v in ours.state_dict().items() if ".mlp.experts." in k and ".layers.1." in k})
    after = full_logits(ours, ids)
    for m in _moe_layers(ours):
        m.all_experts_max_tokens = 0  # the per-expert path reads the parameters
    per_expert = full_logits(ours, ids)
    assert (per_expert - before).abs().max() > 1e-2  # the update matters to the output
    torch.testing.assert_close(after, per_expert, rtol=1e-5, atol=1e-5)


def test_all_experts_path_in_bf16_is_as_close_to_fp32_as_the_per_expert_path(moe_dir):
    """The engine in bf16 (``rollout.dtype``): a MoE layer's output on the all-experts path differs
    from fp32 by bf16 rounding only, no more than the per-expert path's (which rounds each expert's
    weighted output before the sum)."""
    fp32, bf16 = _moe_layers(load_model(moe_dir))[0], _moe_layers(load_model(moe_dir, dtype=torch.bfloat16))[0]
    x = torch.randn(10, fp32.c.hidden_size, generator=torch.Generator().manual_seed(3))
    assert 10 <= bf16.all_experts_max_tokens
    with torch.inference_mode():
        fp32.all_experts_max_tokens = 0
        ref = fp32(x)
        fast = (bf16(x.bfloat16()).float() - ref).abs().mean()
        bf16.all_experts_max_tokens = 0
        per_expert = (bf16(x.bfloat16()).float() - ref).abs().mean()
    assert fast < 0.02 * ref.abs().mean()
    assert fast <= per_expert


def test_tied_embeddings_and_attention_bias_match_transformers(tmp_path):
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-dense")
    cfg.update(tie_word_embeddings=True, attention_bias=True, num_hidden_layers=2, initializer_range=0.1)
    cfg["layer_types"] = ["full_attention"] * 2
    state = hf_model_dir.random_state_dict(cfg, 4)
    for k in [k for k in state if k.endswith(".bias")]:
        state[k] = torch.randn(state[k].shape) * 0.1
    hf_model_dir.save_model_dir(tmp_path, cfg, state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(full_logits(load_model(str(tmp_path)), ids), ref, rtol=1e-5, atol=1e-5)


def test_incremental_decode_matches_full_forward(moe_model):
    ids = torch.randint(3, 98, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    full = full_logits(moe_model, ids)
    kv = RequestKV(moe_model.kv_shape(16))
    rows = []
    with torch.inference_mode():
        kv.ensure_capacity(10)
        h = moe_model.forward_segments(torch.tensor(ids[:10]), torch.arange(10), [(kv, 10)])
        rows.append(moe_model.logits(h)[-1])
        for i in range(10, 30):
            kv.ensure_capacity(i + 1)
            h = moe_model.forward_segments(torch.tensor([ids[i]]), torch.tensor([i]), [(kv, 1)])
            rows.append(moe_model.logits(h)[-1])
    torch.testing.assert_close(torch.stack(rows), full[9:], rtol=1e-4, atol=1e-4)
    assert kv.length == 30 and kv.capacity % 16 == 0


def test_ragged_batch_equals_separate_sequences(moe_model):
    a = list(range(5, 25))
    b = list(range(40, 47))
    kva, kvb = RequestKV(moe_model.kv_shape(16)), RequestKV(moe_model.kv_shape(16))
    kva.ensure_capacity(len(a))
    kvb.ensure_capacity(len(b))
    with torch.inference_mode():
        h = moe_model.forward_segments(
            torch.tensor(a + b), torch.tensor(list(range(len(a))) + list(range(len(b)))), [(kva, len(a)), (kvb, len(b))]
        )
        logits = moe_model.logits(h)
    torch.testing.assert_close(logits[: len(a)], full_logits(moe_model, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[len(a) :], full_logits(moe_model, b), rtol=1e-5, atol=1e-5)


def test_reads_what_transformers_saves(moe_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir)
    hf.save_pretrained(tmp_path)
    ours = hf_model_dir.load_state_dict(tmp_path)
    orig = hf_model_dir.load_state_dict(moe_dir)
    assert set(ours) == set(orig)
    for k in orig:
        assert torch.equal(ours[k], orig[k]), k


def test_unfuse_experts_splits_packed_layout():
    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)
    out = hf_model_dir.unfuse_experts({"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down})
    assert torch.equal(out["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])


def test_load_weights_rejects_bad_names_and_shapes_atomically(moe_dir):
    m = load_model(moe_dir)
    before = m.model.norm.weight.clone()
    bad = {"model.norm.weight": torch.zeros_like(before), "model.bogus.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="unknown weight name 'model.bogus.weight'"):
        m.load_weights(bad)
    with pytest.raises(ValueError, match="shape"):
        m.load_weights({"model.norm.weight": torch.zeros(3)})
    assert torch.equal(m.model.norm.weight, before)


@pytest.mark.parametrize("family,moe_module", [("qwen2_moe", "mlp"), ("mixtral", "block_sparse_moe"),
                                               ("glm4_moe", "mlp"), ("deepseek_v3", "mlp")])
def test_other_families_match_transformers(tmp_path, family, moe_module):
    """Qwen2-MoE (q/k/v biases, no QK-norm, a gated shared expert, top-k weights not renormalised)
    and Mixtral (experts w1/w3/w2 under block_sparse_moe, renormalised top-2), as transformers saves
    them, GLM-4.5 (half-rotary heads, QK-norm, q/k/v biases, a dense first layer, an ungated
    shared expert, sigmoid routing in groups with a correction bias, scaled) and DeepSeek-V3 (MLA,
    GLM-4.5's router and shared experts): our forward equals transformers' on the long (per-expert)
    and the short (all-experts) path."""
    from tests.helpers.hf_dirs import save_family

    model_dir = save_family(tmp_path / family, family)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    ours = load_model(str(model_dir))
    moe_layer = ours.config.sparse_layers[0]
    assert any(k.startswith(f"model.layers.{moe_layer}.{moe_module}.experts.0.") for k in ours.state_dict())
    for n in (40, 8):
        ids = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref.std() > 0.3
        torch.testing.assert_close(full_logits(ours, ids), ref, rtol=1e-5, atol=1e-5)
    # in bf16, every tensor has the dtype transformers gives it (GLM-4.5's router stays fp32)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    theirs = {**dict(hf16.named_parameters()), **dict(hf16.named_buffers())}
    ours16 = load_model(str(model_dir), dtype=torch.bfloat16).state_dict()
    common = [k for k in ours16 if k in theirs]  # (transformers 5 holds experts fused, Mixtral's block as mlp)
    assert family == "mixtral" or any(k.endswith(f"{moe_module}.gate.weight") for k in common)
    assert {k: ours16[k].dtype for k in common} == {k: theirs[k].dtype for k in common}


def test_mla_decodes_from_a_latent_cache_of_kv_lora_rank_plus_rope_values_per_token(tmp_path):
    """DeepSeek-V3's engine caches per token and layer the kv latent and the shared rotary key
    (16 + 8 values in the tiny model), not 4 heads' keys and values (4 * (24 + 16) = 160); decoding
    token by token from it, prefills in chunks included, gives transformers' logits."""
    from tests.helpers.hf_dirs import save_family

    model_dir = save_family(tmp_path / "ds", "deepseek_v3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ours = load_model(str(model_dir))
    c = ours.config
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    kv = RequestKV(ours.kv_shape(16))
    kv.ensure_capacity(len(ids))
    rows = []
    with torch.inference_mode():
        h = ours.forward_segments(torch.tensor(ids[:6]), torch.arange(6), [(kv, 6)])
        rows.append(ours.logits(h))
        h = ours.forward_segments(torch.tensor(ids[6:10]), torch.arange(6, 10), [(kv, 4)])  # chunk after a past
        rows.append(ours.logits(h))
        for i in range(10, len(ids)):
            rows.append(ours.logits(ours.forward_segments(torch.tensor([ids[i]]), torch.tensor([i]), [(kv, 1)])))
    torch.testing.assert_close(torch.cat(rows), ref, rtol=1e-5, atol=1e-5)
    per_token_layer = (kv.k[0].numel() + kv.v[0].numel()) // kv.capacity
    assert per_token_layer == c.kv_lora_rank + c.qk_rope_head_dim == 24
    assert kv.export_tensor().shape[3] == len(ids)


def test_multi_token_prediction_layers_are_skipped_as_transformers_skips_them(tmp_path, caplog):
    """A DeepSeek-V3 checkpoint stores its MTP module as ``model.layers.<num_hidden_layers>``; the
    engine loads the directory without it (saying so), as transformers does, and computes the same."""
    import logging

    from safetensors.torch import load_file, save_file

    from tests.helpers.hf_dirs import save_family

    model_dir = save_family(tmp_path / "ds", "deepseek_v3")
    state = load_file(str(model_dir / "model.safetensors"))
    extra = {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
             "model.layers.2.self_attn.kv_b_proj.weight": torch.randn(128, 16)}
    save_file({**state, **extra}, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = list(range(3, 23))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([ids])).logits[0]
    with caplog.at_level(logging.INFO, logger="dora_megatron.rollout.engine.model"):
        ours = load_model(str(model_dir))
    assert "skipping 3 tensors of multi-token-prediction layers (num_nextn_predict_layers=1)" in caplog.text
    torch.testing.assert_close(full_logits(ours, ids), ref, rtol=1e-5, atol=1e-5)


def test_mla_with_yarn_matches_transformers(tmp_path):
    """DeepSeek-V3's YaRN: the rotary part's blended frequencies and attention factor, and the
    ``mscale_all_dim`` factor on every dimension's softmax scale, past the original length of 8."""
    from tests.helpers.hf_dirs import save_family

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = {}
    for name, rope in (("yarn", yarn), ("plain", {"rope_type": "default", "rope_theta": 10000.0})):
        model_dir = save_family(tmp_path / name, "deepseek_v3", rope_parameters=rope)
        with torch.no_grad():
            ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()(torch.tensor([ids])).logits[0]
        logits[name] = ref
        torch.testing.assert_close(full_logits(load_model(str(model_dir)), ids), ref, rtol=1e-5, atol=1e-5)
    assert (logits["yarn"] - logits["plain"]).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}])
def test_scaled_rope_matches_transformers_and_the_trainer_takes_only_yarn(tmp_path, rope):
    """YaRN (frequencies blended by position band, cos/sin scaled by its attention factor) and linear
    scaling: the engine computes them as transformers does; the trainer (Megatron's GPT YaRN path)
    takes YaRN and refuses linear, and so does the job's model check."""
    from dora_megatron.models.hf_model_dir import check_model_dir
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-dense")
    cfg.update(num_hidden_layers=2, initializer_range=0.1, rope_parameters=rope, max_position_embeddings=64)
    cfg["layer_types"] = ["full_attention"] * 2
    hf_model_dir.save_model_dir(tmp_path, cfg, hf_model_dir.random_state_dict(cfg, 4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_model(str(tmp_path))
    ids = list(range(3, 43))  # past original_max_position_embeddings
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(full_logits(ours, ids), ref, rtol=1e-5, atol=1e-5)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    hf_model_dir.save_model_dir(tmp_path / "plain", cfg, hf_model_dir.random_state_dict(cfg, 4))
    assert (full_logits(load_model(str(tmp_path / "plain")), ids) - ref).abs().max() > 1e-3  # the scaling mattered
    assert check_model_dir(tmp_path, need_tokenizer=False, engine_only=True) == []
    if rope["rope_type"] == "yarn":
        assert check_model_dir(tmp_path, need_tokenizer=False) == []
        return
    (problem,) = check_model_dir(tmp_path, need_tokenizer=False)
    assert f"rope_type {rope['rope_type']!r} is not supported by the Megatron trainer" in problem
