"""A DeepSeek-V3 checkpoint with its multi-token-prediction layer (``num_nextn_predict_layers: 1``,
stored as ``model.layers.<num_hidden_layers>.*`` like the Hub's ``model.layers.61.*``) goes into the
trainer and through ``dora convert``: the MTP tensors are skipped with a warning that counts them,
the trainer's logits are transformers' (which skips them too), and HF -> Megatron -> HF gives back
every other tensor bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import hf_dirs

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def with_mtp_layer(model_dir) -> list[str]:
    """Add to ``model_dir``'s safetensors the tensors of one DeepSeek-V3 MTP layer (a whole MoE
    decoder layer, its embedding and head, the two input norms and ``eh_proj``, as the Hub's
    checkpoint names them), random; returns their names."""
    from safetensors.torch import load_file, save_file

    from dora_megatron.models.hf_config import read_spec

    spec = read_spec(model_dir)
    n, h, v = spec.num_layers, spec.hidden_size, spec.vocab_size
    last = f"model.layers.{n - 1}."
    shapes = {f"model.layers.{n}.{k[len(last):]}": s for k, s in spec.expected_shapes().items() if k.startswith(last)}
    mtp = f"model.layers.{n}."
    shapes.update({mtp + "embed_tokens.weight": (v, h), mtp + "enorm.weight": (h,), mtp + "hnorm.weight": (h,),
                   mtp + "eh_proj.weight": (h, 2 * h), mtp + "shared_head.norm.weight": (h,),
                   mtp + "shared_head.head.weight": (v, h)})
    g = torch.Generator().manual_seed(7)
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    state.update({k: torch.randn(s, generator=g) for k, s in shapes.items()})
    save_file(state, str(path), metadata={"format": "pt"})
    return sorted(shapes)


def _dora(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dora_megatron", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_mtp_tensors_are_skipped_with_a_warning_and_nothing_else_is_lost(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers.trainer_parity import fixed_inputs
    from tests.helpers.trainer_scenarios import run_scenario

    src = hf_dirs.save_family(tmp_path / "ds", "deepseek_v3", num_nextn_predict_layers=1)
    plain = load_file(str(src / "model.safetensors"))
    mtp = with_mtp_layer(src)
    assert len(mtp) > 30 and "model.layers.2.mlp.experts.7.down_proj.weight" in mtp

    # the trainer's loader: every parameter filled from the other tensors, logits as transformers'
    res = run_scenario(["step", "--hf", str(src)], 1, str(tmp_path / "r.pt"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(row[None]).logits[0] for row in fixed_inputs(hf_dirs.VOCAB)])
    torch.testing.assert_close(res["logits"], ref, rtol=1e-5, atol=1e-5)

    to_megatron = _dora("convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "ckpt"))
    assert f"skipping {len(mtp)} tensors of 1 multi-token-prediction layer(s)" in to_megatron.stderr, \
        to_megatron.stderr[-3000:]
    _dora("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(plain)
    for k, t in plain.items():
        assert torch.equal(back[k], t), k
