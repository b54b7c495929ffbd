"""`dora init-model` writes a directory transformers loads, deterministic in the seed."""

from __future__ import annotations

import json

import pytest
import torch

from dora_megatron.cli import init_model
from dora_megatron.models import hf_model_dir

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("preset,arch", [("tiny-moe", "Qwen3MoeForCausalLM"), ("tiny-dense", "Qwen3ForCausalLM")])
def test_init_model_cli_writes_loadable_dir(tmp_path, preset, arch):
    out = tmp_path / "m"
    assert init_model.main(["--preset", preset, "--out", str(out), "--seed", "3"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["vocab_size"] == 128 and cfg["num_hidden_layers"] == 4
    assert (out / "tokenizer.json").is_file()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == arch
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = hf_model_dir.load_state_dict(out)
    assert set(state) == set(hf_model_dir.expected_shapes(cfg))
    assert all(t.dtype == torch.float32 for t in state.values())
    if preset == "tiny-moe":
        assert state["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (128, 128)
        assert state["model.layers.0.mlp.gate.weight"].shape == (8, 128)


def test_seed_determines_weights(tmp_path):
    a, b, c = (init_model.main(["--preset", "tiny-dense", "--out", str(tmp_path / n), "--seed", s]) for n, s in
               (("a", "1"), ("b", "1"), ("c", "2")))
    assert a == b == c == 0
    sa, sb, sc = (hf_model_dir.load_state_dict(tmp_path / n) for n in "abc")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
