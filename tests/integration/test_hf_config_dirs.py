"""A Qwen3-MoE directory written by the installed transformers' ``save_pretrained``, and the same
weights with a Hub-spelled ``config.json``, through the real commands: ``dora serve`` generates
with transformers' log-probs (fp32), the Megatron trainer's logits equal transformers', and
``dora convert`` HF -> Megatron -> HF gives back the exact bytes of every tensor.

(Before: ``dora serve`` refused the ``save_pretrained`` directory, reading it as dense: ``unknown
weight name 'model.layers.0.mlp.experts.0.down_proj.weight'``; on the Hub-spelled one it and the
trainer renormalised the top-k routing weights, which transformers does not when the config omits
``norm_topk_prob``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from dora_megatron.rollout.engine.process import start_engine
from tests.helpers import hf_dirs
from tests.helpers.trainer_scenarios import run_matrix, run_scenario

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the families beyond Qwen3 / Qwen3-MoE, each saved by transformers (tests.helpers.hf_dirs.save_family)
FAMILIES = ("qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
YARN = {"rope_type": "yarn", "rope_theta": hf_dirs.ROPE_THETA, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
#: YaRN on the grouped-query families (Megatron's GPT YaRN path): Qwen3-MoE with transformers'
#: defaults (cos/sin scaled by 0.1 ln(factor) + 1), Qwen2-MoE with an mscale pair and other betas,
#: GLM-4.5 with a partial rotary
V4_FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
GQA_YARN = {"moe-yarn": ("qwen3_moe", {"rope_type": "yarn", "rope_theta": hf_dirs.ROPE_THETA, "factor": 4.0,
                                       "original_max_position_embeddings": 8}),
            "qwen2_moe-yarn": ("qwen2_moe", {"rope_type": "yarn", "rope_theta": hf_dirs.ROPE_THETA, "factor": 8.0,
                                             "original_max_position_embeddings": 8, "mscale": 2.0,
                                             "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0}),
            # GLM-4.5's partial rotary (half of each head) with YaRN over that half
            "glm4_moe-yarn": ("glm4_moe", {"rope_type": "yarn", "rope_theta": hf_dirs.ROPE_THETA, "factor": 4.0,
                                           "original_max_position_embeddings": 8, "partial_rotary_factor": 0.5})}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    saved = hf_dirs.save_pretrained(root / "moe-saved", moe=True)
    dense = hf_dirs.save_pretrained(root / "dense-saved", moe=False)
    # a Qwen3-MoE whose first layer is dense (mlp_only_layers), 4 layers so that pp=2 splits dense from MoE
    dense_layers = hf_dirs.save_pretrained(root / "moe-dense-layers", moe=True, mlp_only_layers=[0],
                                           num_hidden_layers=4)
    return {"moe-saved": saved, "moe-dense-layers": dense_layers, "moe-hub": hf_dirs.hub_spelled(saved, root / "moe-hub"), "dense-saved": dense,
            **{f: hf_dirs.save_family(root / f, f) for f in FAMILIES},
            # tied embeddings (no lm_head.weight in the directory), which GLM-4.5's config allows
            "glm4_moe-tied": hf_dirs.save_family(root / "glm4_moe-tied", "glm4_moe", tie_word_embeddings=True),
            "glm4_moe-bf16": _bf16_copy(root / "glm4_moe", root / "glm4_moe-bf16"),
            # DeepSeek-V3's YaRN (factor, mscale_all_dim on the softmax scale) past an original length of 8
            "deepseek_v3-yarn": hf_dirs.save_family(root / "deepseek_v3-yarn", "deepseek_v3", rope_parameters=YARN),
            "qwen3_moe": hf_dirs.save_family(root / "qwen3_moe", "qwen3_moe"),
            # each family with its hand-written transformers-4.x config.json (tests/helpers/hf_configs_v4)
            **{f"v4-{f}": hf_dirs.save_v4(root / f"v4-{f}", f) for f in V4_FAMILIES},
            # 4 layers, the first dense: pp=2 puts the dense layer and an MoE layer on stage 0, two MoE on stage 1
            "deepseek_v3-4-layers": hf_dirs.save_family(root / "deepseek_v3-4-layers", "deepseek_v3",
                                                        num_hidden_layers=4, first_k_dense_replace=1),
            # 3 layers, the first dense: an uneven pipeline of 1 + 2 layers (num_layers_in_first_pipeline_stage)
            "deepseek_v3-3-layers": hf_dirs.save_family(root / "deepseek_v3-3-layers", "deepseek_v3",
                                                        num_hidden_layers=3, first_k_dense_replace=1),
            **{name: hf_dirs.save_family(root / name, fam, rope_parameters=rope) for name, (fam, rope) in GQA_YARN.items()},
            # a full-rank q_proj instead of the q latent (q_lora_rank null, as DeepSeek-V2-Lite)
            "deepseek_v3-no-q-lora": hf_dirs.save_family(root / "deepseek_v3-no-q-lora", "deepseek_v3", q_lora_rank=None)}


def _bf16_copy(src, out):
    """``src`` as transformers saves it loaded in bf16: GLM-4.5's router weight and correction bias
    stay fp32 (``_keep_in_fp32_modules_strict``), the rest bf16."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    return out


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("name", ["moe-saved", "moe-hub", "dense-saved", *FAMILIES, "glm4_moe-tied",
                                  "deepseek_v3-no-q-lora", "v4-qwen2_moe", "v4-deepseek_v3"])
def test_dora_serve_generates_with_transformers_logprobs(dirs, name):
    prompt = torch.randint(3, hf_dirs.VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = start_engine(str(dirs[name]), timeout_s=300)
    try:
        out = _post(engine.url + "/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}})
    finally:
        engine.stop()
    ids = out["output_ids"]
    assert len(ids) == 10
    logprobs = torch.log_softmax(_hf_logits(dirs[name], prompt + ids), dim=-1)[len(prompt) - 1: -1]
    assert ids == logprobs.argmax(-1).tolist()  # greedy: transformers' argmax at every step
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, logprobs[torch.arange(len(ids)), torch.tensor(ids)], rtol=1e-5, atol=1e-5)


def _deepseek_routing_matters(model_dir, ids: list[int]) -> None:
    """The tiny DeepSeek-V3's correction bias and group limit each change transformers' logits, so a
    trainer that dropped either could not match them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
        for gate in gates:
            gate.e_score_correction_bias.zero_()
        no_bias = model(torch.tensor([ids])).logits[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for gate in [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]:
        gate.num_group = gate.topk_group = 1
    with torch.no_grad():
        no_groups = model(torch.tensor([ids])).logits[0]
    assert (ref - no_bias).abs().max() > 1e-2 and (ref - no_groups).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["moe-saved", "moe-hub", "moe-dense-layers", *FAMILIES, "glm4_moe-tied",
                                  "deepseek_v3-yarn", "deepseek_v3-no-q-lora", *GQA_YARN])
def test_megatron_trainer_logits_equal_transformers(dirs, name, tmp_path):
    from tests.helpers.trainer_parity import fixed_inputs

    res = run_scenario(["step", "--hf", str(dirs[name])], 1, str(tmp_path / "r.pt"))
    ids = fixed_inputs(hf_dirs.VOCAB)
    ref = torch.stack([_hf_logits(dirs[name], row.tolist()) for row in ids])
    assert ref.std() > 0.3
    if name == "deepseek_v3":
        _deepseek_routing_matters(dirs[name], ids[0].tolist())
    if name.endswith("-yarn"):  # the same weights with the default RoPE: YaRN changed the logits
        plain_dir = dirs[GQA_YARN[name][0] if name in GQA_YARN else "deepseek_v3"]
        plain = torch.stack([_hf_logits(plain_dir, row.tolist()) for row in ids])
        assert (plain - ref).abs().max() > 1e-2
    torch.testing.assert_close(res["logits"], ref, rtol=1e-5, atol=1e-5)


def test_megatron_trainer_logits_equal_transformers_with_tp_and_ep(dirs, tmp_path):
    """Each family on 2 ranks, TP=2 (sequence parallel, sharded q/k/v biases and shared expert; MLA's
    sharded projections) and EP=2, built one after another in one torchrun world."""
    from tests.helpers.trainer_parity import fixed_inputs

    items = [f"{f}:{layout}" for f in FAMILIES for layout in ("tp=2", "ep=2")]
    results = {r["item"]: r for r in run_matrix(items, 2, {f: str(dirs[f]) for f in FAMILIES},
                                                str(tmp_path / "m.pt"))}
    ids = fixed_inputs(hf_dirs.VOCAB)
    assert sorted(results) == sorted(items)
    for item, res in results.items():
        family = item.partition(":")[0]
        ref = torch.stack([_hf_logits(dirs[family], row.tolist()) for row in ids])
        torch.testing.assert_close(res["logits"], ref, rtol=1e-5, atol=1e-5, msg=item)


def test_4x_configs_trainer_logits_equal_transformers(dirs, tmp_path):
    """Each family's hand-written transformers-4.x config.json (YaRN keyed by ``type`` on Qwen3-MoE
    and DeepSeek-V3, ``rope_theta`` on the config, ...): the trainer's logits equal those of the
    model transformers builds from that file; all built one after another in one process."""
    from tests.helpers.trainer_parity import fixed_inputs

    names = [f"v4-{f}" for f in V4_FAMILIES]
    results = {r["item"]: r for r in run_matrix([f"{n}:" for n in names], 1, {n: str(dirs[n]) for n in names},
                                                str(tmp_path / "m.pt"))}
    assert sorted(results) == sorted(f"{n}:" for n in names)
    for name in names:
        ids = fixed_inputs(hf_dirs.v4_config(name[3:])["vocab_size"])
        ref = torch.stack([_hf_logits(dirs[name], row.tolist()) for row in ids])
        assert ref.std() > 0.3, name
        torch.testing.assert_close(results[f"{name}:"]["logits"], ref, rtol=1e-5, atol=1e-5, msg=name)


def test_deepseek_v3_pipeline_parallel_equals_one_stage(dirs, tmp_path):
    """DeepSeek-V3 (MLA, a dense first layer, MoE after it) over a 2-stage pipeline: each stage
    builds its own layers' kinds (the dense layer and an MoE layer on stage 0, two MoE layers on
    stage 1), the logits equal transformers', and one training step gives the 1-stage run's loss,
    grad norm and updated weights."""
    one = _two_stages_equal_one(dirs["deepseek_v3-4-layers"], tmp_path)
    assert "model.layers.0.mlp.gate_proj.weight" in one["weights"]  # layer 0 dense, layers 1-3 MoE
    assert "model.layers.3.mlp.experts.0.up_proj.weight" in one["weights"]


def _two_stages_equal_one(model_dir, tmp_path, *trainer_sets: str, one_equals_hf: bool = False) -> dict:
    """One training step of ``model_dir`` on 2 pipeline stages (``trainer_sets``: ``--trainer``
    overrides) against 1: the 2-stage logits equal transformers' (and the 1-stage ones with
    ``one_equals_hf``), loss, entropy, grad norm and token count agree, and every updated weight,
    exported under its HF name from either stage, is the 1-stage one's; returns the 1-stage result."""
    from tests.helpers.trainer_parity import fixed_inputs
    from tests.helpers.trainer_scenarios import LR

    one = run_scenario(["step", "--hf", str(model_dir)], 1, str(tmp_path / "one.pt"))
    two = run_scenario(["step", "--hf", str(model_dir), "--pp", "2",
                        *(arg for s in trainer_sets for arg in ("--trainer", s))], 2, str(tmp_path / "two.pt"))
    ref = torch.stack([_hf_logits(model_dir, row.tolist()) for row in fixed_inputs(hf_dirs.VOCAB)])
    torch.testing.assert_close(two["logits"], ref, rtol=1e-5, atol=1e-5)
    if one_equals_hf:
        torch.testing.assert_close(one["logits"], ref, rtol=1e-5, atol=1e-5)
    for key in ("loss", "entropy", "grad_norm", "num_tokens"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    assert set(two["weights"]) == set(one["weights"])
    for name, w in one["weights"].items():
        assert (two["weights"][name] - w).abs().max().item() < LR / 10, name
    return one


def test_deepseek_v3_uneven_pipeline_equals_one_stage(dirs, tmp_path):
    """DeepSeek-V3's 3 layers over 2 stages of 1 and 2 layers (Megatron's
    ``num_layers_in_first_pipeline_stage: 1``; an even split cannot hold 3 layers): stage 0 builds
    and loads the dense layer 0, stage 1 the MoE layers 1 and 2. The logits equal transformers', one
    training step gives the 1-stage run's loss, grad norm and updated weights, exported (the weight
    push's path) from both stages under their HF names."""
    one = _two_stages_equal_one(dirs["deepseek_v3-3-layers"], tmp_path,
                                "megatron.num_layers_in_first_pipeline_stage=1", one_equals_hf=True)
    assert "model.layers.0.mlp.gate_proj.weight" in one["weights"]  # layer 0 dense, layers 1-2 MoE
    assert "model.layers.2.mlp.experts.0.up_proj.weight" in one["weights"]


def test_dora_convert_uneven_pipeline_round_trip_is_bit_exact(dirs, tmp_path):
    """HF -> Megatron written by 2 stages of 1 + 2 layers -> HF read by 2 stages of 2 + 1 layers
    (``--last-stage-layers 1``: each stage reads layers the other wrote) gives back every tensor's
    bytes. (DeepSeek-V3's pipeline round trip: MLA, the dense first layer and the MoE layers on
    other stages; test_dora_convert_round_trip_is_bit_exact covers the even split with other families.)"""
    from safetensors.torch import load_file

    src = dirs["deepseek_v3-3-layers"]
    _dora("convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "ckpt"), "--pp", "2",
          "--first-stage-layers", "1")
    meta = json.loads((tmp_path / "ckpt" / "dora_convert.json").read_text())
    assert meta["pp"] == 2 and meta["num_layers_in_first_pipeline_stage"] == 1
    _dora("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"), "--pp", "2",
          "--last-stage-layers", "1")
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(after) == sorted(before) and "model.layers.2.mlp.experts.3.up_proj.weight" in before
    for k, t in before.items():
        assert after[k].dtype == t.dtype and torch.equal(after[k], t), k


def _dora(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dora_megatron", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("name,layout", [("moe-saved", ["--ep", "2"]), ("moe-hub", []),
                                         ("qwen2_moe", ["--tp", "2"]), ("mixtral", ["--ep", "2"]),
                                         ("moe-dense-layers", ["--pp", "2"]), ("glm4_moe", ["--ep", "2"]),
                                         ("glm4_moe", ["--tp", "2", "--pp", "2"]), ("glm4_moe-tied", ["--pp", "2"]),
                                         ("glm4_moe-bf16", []),
                                         ("deepseek_v3", ["--tp", "2"]), ("deepseek_v3", ["--ep", "2"]),
                                         ("qwen2_moe-yarn", ["--tp", "2"]),
                                         ("deepseek_v3-no-q-lora", ["--tp", "2"])])
def test_dora_convert_round_trip_is_bit_exact(dirs, name, layout, tmp_path):
    from safetensors.torch import load_file

    src = dirs[name]
    _dora("convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "ckpt"), *layout)
    _dora("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"))
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(after) == sorted(before) and any(".experts.3." in k for k in before)
    assert ("lm_head.weight" in before) == (not name.endswith("-tied"))
    if name.startswith("deepseek_v3"):  # no q latent: a full-rank q_proj, sharded by rows over TP as linear_q_proj
        assert ("model.layers.0.self_attn.q_proj.weight" in before) == (name == "deepseek_v3-no-q-lora")
    if name == "glm4_moe-bf16":  # a mixed-dtype checkpoint comes back in its dtypes, the bias in fp32
        assert before["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert before["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    for k, t in before.items():
        assert after[k].dtype == t.dtype and torch.equal(after[k], t), k
    assert (tmp_path / "back" / "config.json").read_text() == (src / "config.json").read_text()
