"""Block-FP8 checkpoints (DeepSeek-V3's published layout): the trainer's reader, the embedded
engine's reader and transformers read the same full-precision weights from them; what dora writes
back is full precision and says so; what cannot be read is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dora_megatron.models import fp8_checkpoint
from dora_megatron.models.hf_model_dir import check_model_dir, load_state_dict, unfuse_experts
from dora_megatron.rollout.engine.model import load_model
from dora_megatron.trainer.hf_weights import read_hf_safetensors
from dora_megatron.weights.snapshots import write_snapshot
from tests.helpers.engine_logits import full_logits
from tests.helpers.hf_dirs import fp8_quantize, save_family, save_fp8

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 and its block-FP8 copies with 8x8 and 16x16 tiles (its 24-row
    ``kv_a_proj_with_mqa`` ends in a partial 16-row tile)."""
    root = tmp_path_factory.mktemp("fp8")
    src = save_family(root / "ds", "deepseek_v3", seed=3)
    return src, save_fp8(src, root / "ds_fp8", (8, 8)), save_fp8(src, root / "ds_fp8_16", (16, 16))


def test_tiles_of_every_magnitude_dequantize_to_their_weights_partial_edge_tiles_included():
    # each tile scaled by its own power of ten: a scale read from a neighbouring tile is off by >= 10x
    state = {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": torch.randn(24, 40, generator=torch.Generator().manual_seed(0))}
    quantized, reference = fp8_quantize(state, (16, 16), magnitudes=True)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert quantized[name].dtype == torch.float8_e4m3fn and quantized[name[:-6] + "weight_scale_inv"].shape == (2, 3)
    out = fp8_checkpoint.dequantize_state(quantized, {"quantization_config": {**FP8, "weight_block_size": [16, 16]}})
    assert set(out) == {name} and out[name].dtype == torch.float32
    ref = reference[name]
    assert ref.abs().max() / ref.abs().min() > 1e4  # the magnitudes span orders
    # e4m3 keeps 3 mantissa bits: a normal value within 1/16 of itself; a subnormal (below 2^-6 of
    # the scale) within half of the 2^-9 step; the tile's scale is its largest value / 448
    tile_max = torch.zeros_like(ref)
    for i in range(2):
        for j in range(3):
            tile_max[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] = ref[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16].abs().max()
    assert ((out[name] - ref).abs() <= ref.abs() * (1 / 16 + 1e-6) + tile_max / 448 * 2.0 ** -10).all()


def test_the_engine_and_the_trainer_read_the_weights_transformers_reads(deepseek):
    # transformers dequantizes a pre-quantized FP8 checkpoint on a machine without a GPU
    src, fp8_dir, _ = deepseek
    theirs = unfuse_experts(transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).state_dict())
    for ours in (read_hf_safetensors(str(fp8_dir)), load_state_dict(fp8_dir)):
        assert not any(k.endswith("weight_scale_inv") for k in ours)
        common = sorted(set(ours) & set(theirs))
        assert len(common) >= len(ours) - 2  # transformers 5 keeps the routing bias as a buffer of its own name
        for k in common:
            assert torch.equal(ours[k].float(), theirs[k].float()), k
    original = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert load_file(str(fp8_dir / "model.safetensors"))[name].dtype == torch.float8_e4m3fn
    assert 0 < (read_hf_safetensors(str(fp8_dir))[name] - original[name]).abs().max() < 0.1 * original[name].abs().max()


def test_the_engine_serves_an_fp8_checkpoint_with_transformers_logits(deepseek):
    src, fp8_dir, _ = deepseek
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()(ids).logits[0]
        unquantized = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits[0]
        ours = full_logits(load_model(str(fp8_dir)), ids[0].tolist())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (theirs - unquantized).abs().max() > 1e-3  # the quantization is there to see


def test_snapshots_of_an_fp8_source_are_full_precision_and_say_so(deepseek, tmp_path):
    _, fp8_dir, _ = deepseek
    state = read_hf_safetensors(str(fp8_dir))
    write_snapshot(tmp_path / "v000001", state, fp8_dir, version=1)
    config = json.loads((tmp_path / "v000001" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    written = load_file(str(tmp_path / "v000001" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in written.values())
    # and the snapshot reads back as the same weights (no quantization assumed)
    assert all(torch.equal(load_state_dict(tmp_path / "v000001")[k], state[k]) for k in written)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq"}, r"quantization_config.quant_method 'awq' is not supported"),
    ({**FP8, "fmt": "e5m2"}, r"quantization_config.fmt 'e5m2'"),
    ({**FP8, "weight_block_size": None}, r"weight_block_size must be two positive integers.*per-tensor"),
    ({**FP8, "weight_block_size": [128, 0]}, r"weight_block_size"),
    ("fp8", r"quantization_config must be an object"),
])
def test_quantizations_dora_cannot_read_are_named(deepseek, tmp_path, quant, match):
    with pytest.raises(ValueError, match=match):
        fp8_checkpoint.fp8_block({"quantization_config": quant})
    _, fp8_dir, _ = deepseek
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fp8_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    problems = check_model_dir(bad, need_tokenizer=False)  # found before any process starts
    assert len(problems) == 1 and "quantization_config" in problems[0] and str(bad) in problems[0]


def test_scales_and_fp8_tensors_that_do_not_pair_are_named():
    q = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    config = {"quantization_config": FP8}
    with pytest.raises(ValueError, match=r"a\.weight_scale_inv: shape \(3, 2\) does not tile a 16x16 weight in 8x8 blocks \(expected \(2, 2\)\)"):
        fp8_checkpoint.dequantize_state({"a.weight": q, "a.weight_scale_inv": torch.ones(3, 2)}, config)
    with pytest.raises(ValueError, match=r"b\.weight_scale_inv: a scale without its weight b\.weight"):
        fp8_checkpoint.dequantize_state({"b.weight_scale_inv": torch.ones(2, 2)}, config)
    with pytest.raises(ValueError, match=r"c\.weight: an FP8 tensor without its weight_scale_inv"):
        fp8_checkpoint.dequantize_state({"c.weight": q}, config)
    with pytest.raises(ValueError, match=r"no quantization_config, yet 1 tensor\(s\) are FP8 \(first: d\.weight\)"):
        fp8_checkpoint.dequantize_state({"d.weight": q, "e.weight": torch.zeros(2)}, {})


def test_external_engines_refuse_an_fp8_checkpoint_and_say_how_to_convert(deepseek, own_model, tmp_path):
    import shutil

    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.launch.inputs import model_path_problem

    fp8_dir = shutil.copytree(deepseek[1], tmp_path / "ds_fp8")
    shutil.copy(own_model.model_dir / "tokenizer.json", fp8_dir)  # the launch checks it is there
    for engine in ("sglang", "vllm"):
        cfg = DoraConfig()
        cfg.model.path, cfg.rollout.engine = str(fp8_dir), engine
        problem = model_path_problem(cfg)
        assert problem is not None and "block-FP8" in problem and f"rollout.engine '{engine}'" in problem
        assert "dora convert" in problem
    cfg = DoraConfig()
    cfg.model.path = str(fp8_dir)
    assert model_path_problem(cfg) is None  # the embedded engine dequantizes it
