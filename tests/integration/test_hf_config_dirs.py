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
FAMILIES = ("qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    saved = hf_dirs.save_pretrained(root / "moe-saved", moe=True)
    dense = hf_dirs.save_pretrained(root / "dense-saved", moe=False)
    # a Qwen3-MoE whose first layer is dense (mlp_only_layers), 4 layers so that pp=2 splits dense from MoE
    dense_layers = hf_dirs.save_pretrained(root / "moe-dense-layers", moe=True, mlp_only_layers=[0],
                                           num_hidden_layers=4)
    return {"moe-saved": saved, "moe-dense-layers": dense_layers, "moe-hub": hf_dirs.hub_spelled(saved, root / "moe-hub"), "dense-saved": dense,
            **{f: hf_dirs.save_family(root / f, f) for f in FAMILIES}}


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("name", ["moe-saved", "moe-hub", "dense-saved", *FAMILIES])
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


@pytest.mark.parametrize("name", ["moe-saved", "moe-hub", "moe-dense-layers", *FAMILIES])
def test_megatron_trainer_logits_equal_transformers(dirs, name, tmp_path):
    from dora_megatron.trainer.parity import fixed_inputs

    res = run_scenario(["step", "--hf", str(dirs[name])], 1, str(tmp_path / "r.pt"))
    ids = fixed_inputs(hf_dirs.VOCAB)
    ref = torch.stack([_hf_logits(dirs[name], row.tolist()) for row in ids])
    assert ref.std() > 0.3
    torch.testing.assert_close(res["logits"], ref, rtol=1e-5, atol=1e-5)


def test_megatron_trainer_logits_equal_transformers_with_tp_and_ep(dirs, tmp_path):
    """Each family on 2 ranks, TP=2 (sequence parallel, sharded q/k/v biases and shared expert) and
    EP=2, built one after another in one torchrun world."""
    from dora_megatron.trainer.parity import fixed_inputs

    items = [f"{f}:{layout}" for f in FAMILIES for layout in ("tp=2", "ep=2")]
    results = {r["item"]: r for r in run_matrix(items, 2, {f: str(dirs[f]) for f in FAMILIES}, str(tmp_path / "m.pt"))}
    ids = fixed_inputs(hf_dirs.VOCAB)
    assert sorted(results) == sorted(items)
    for item, res in results.items():
        family = item.partition(":")[0]
        ref = torch.stack([_hf_logits(dirs[family], row.tolist()) for row in ids])
        torch.testing.assert_close(res["logits"], ref, rtol=1e-5, atol=1e-5, msg=item)


def _dora(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dora_megatron", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("name,layout", [("moe-saved", ["--ep", "2"]), ("moe-hub", []),
                                         ("qwen2_moe", ["--tp", "2"]), ("mixtral", ["--ep", "2"]),
                                         ("moe-dense-layers", ["--pp", "2"])])
def test_dora_convert_round_trip_is_bit_exact(dirs, name, layout, tmp_path):
    from safetensors.torch import load_file

    src = dirs[name]
    _dora("convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "ckpt"), *layout)
    _dora("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"))
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(after) == sorted(before) and any(".experts.3." in k for k in before)
    for k, t in before.items():
        assert after[k].dtype == t.dtype and torch.equal(after[k], t), k
    assert (tmp_path / "back" / "config.json").read_text() == (src / "config.json").read_text()
