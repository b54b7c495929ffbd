"""Directories written by the installed transformers and Hub-spelled configs: one reading for all.

The engine's forward pass on such a directory equals transformers' (fp32), the trainer and the
input checks read the same architecture, and what transformers refuses is refused up front with
the file and the field named. (Before: the engine read a ``save_pretrained`` Qwen3-MoE directory,
which spells ``num_local_experts``, as a dense model and failed on the expert weights, and a
config that omits ``norm_topk_prob`` was routed with renormalised top-k where transformers does not.)
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from dora_megatron.models import hf_config
from dora_megatron.models.hf_model_dir import check_model_dir
from dora_megatron.rollout.engine.model import load_model
from tests.helpers import hf_dirs
from tests.helpers.engine_logits import full_logits

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, moe in (("moe", True), ("dense", False)):
        out[f"{kind}-saved"] = hf_dirs.save_pretrained(root / f"{kind}-saved", moe=moe)
        out[f"{kind}-hub"] = hf_dirs.hub_spelled(out[f"{kind}-saved"], root / f"{kind}-hub")
    return out


def test_saved_config_uses_the_new_spellings(dirs):
    """Guards the premise: the installed transformers writes what the Hub does not."""
    saved = json.loads((dirs["moe-saved"] / "config.json").read_text())
    hub = json.loads((dirs["moe-hub"] / "config.json").read_text())
    assert "num_local_experts" in saved and "rope_parameters" in saved and "num_experts" not in saved
    assert "num_experts" in hub and "rope_theta" in hub and "norm_topk_prob" not in hub


@pytest.mark.parametrize("name", ["moe-saved", "moe-hub", "dense-saved", "dense-hub"])
def test_engine_logits_equal_transformers(dirs, name):
    hf = transformers.AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).eval()
    ids = torch.randint(3, hf_dirs.VOCAB, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ref.std() > 0.3  # the layers matter, not just embedding -> head
    torch.testing.assert_close(full_logits(load_model(str(dirs[name])), ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_every_spelling_is_one_architecture_for_every_component(dirs, kind):
    from dora_megatron.trainer.model import load_arch

    saved, hub = dirs[f"{kind}-saved"], dirs[f"{kind}-hub"]
    spec = hf_config.read_spec(saved)
    assert hf_config.read_spec(hub) == spec
    assert load_arch(str(saved)) == spec and load_arch(str(hub)) == spec
    assert load_model(str(hub)).config == spec
    assert (spec.rope_theta, spec.num_experts, spec.norm_topk_prob) == (
        (hf_dirs.ROPE_THETA, 4, False) if kind == "moe" else (hf_dirs.ROPE_THETA, 0, False))
    assert check_model_dir(saved, need_tokenizer=False) == [] and check_model_dir(hub, need_tokenizer=False) == []


def _rewrite(src, dst, **patch):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(patch)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_value_transformers_refuses_is_named_by_every_reader(dirs, tmp_path):
    from dora_megatron.trainer.model import load_arch

    bad = _rewrite(dirs["moe-hub"], tmp_path / "bad", num_experts="four")
    where = str(bad / "config.json")
    for read in (hf_config.read_spec, lambda d: load_model(str(d)), lambda d: load_arch(str(d))):
        with pytest.raises(ValueError, match="num_experts") as err:
            read(bad)
        assert where in str(err.value) and "transformers" in str(err.value)
    (problem,) = check_model_dir(bad, need_tokenizer=False)
    assert problem.startswith(where) and "num_experts" in problem


@pytest.mark.parametrize("base,patch,engine_refuses,needle", [
    ("dense-saved", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, True,
     "rope_type 'dynamic'"),
    ("dense-saved", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, False,
     "rope_type 'linear' is not supported by the Megatron trainer"),  # the engine computes it
    ("dense-saved", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}, True,
     "sliding-window attention (use_sliding_window / layer_types) on layers [1]"),
    ("moe-saved", {"attention_bias": True}, False, "attention_bias=true (an o_proj bias)"),  # the engine computes it
])
def test_unsupported_architectures_are_refused_before_start(dirs, tmp_path, base, patch, engine_refuses, needle):
    """What transformers reads but a component cannot compute is named by the input check, and
    the component refuses it instead of computing another model."""
    from dora_megatron.trainer.model import load_arch

    d = _rewrite(dirs[base], tmp_path / "d", **patch)
    (problem,) = check_model_dir(d, need_tokenizer=False)
    assert problem.startswith(str(d / "config.json")) and needle in problem
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_arch(str(d))
    if engine_refuses:
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_model(str(d))


def test_dora_serve_refuses_a_bad_config_with_exit_2(dirs, tmp_path, capsys):
    from dora_megatron.cli import serve

    bad = _rewrite(dirs["moe-hub"], tmp_path / "bad", num_experts="four")
    assert serve.main(["--model", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err
    # one line, before the model loads: the input check names the file, transformers' verdict and the field
    assert err.startswith(f"dora serve: --model {bad}") and err.count("\n") == 1
    assert f"{bad / 'config.json'}: transformers" in err and "num_experts" in err
