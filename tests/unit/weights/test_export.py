"""A version as a Hugging Face directory: the snapshot's weights (hard-linked) and config (its dtype
what the tensors hold) plus the source model's tokenizer, chat template and generation config."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dora_megatron.models.hf_model_dir import load_state_dict
from dora_megatron.weights.export import export_final, export_hf, kept_versions, version_weights
from dora_megatron.weights.snapshots import SnapshotStore


@pytest.fixture()
def run_dir(own_model, tmp_path):
    """A run directory with snapshots of versions 1 and 2 written as the trainer writes them (fp32)."""
    state = {k: v.float() for k, v in load_state_dict(own_model.model_dir).items()}
    store = SnapshotStore(tmp_path / "run" / "weights")
    for v in (1, 2):
        store.write(v, {k: t + 0.01 * v for k, t in state.items()}, own_model.model_dir)
    return tmp_path / "run"


def test_a_snapshot_exports_whole_with_the_chat_template(own_model, run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snap = version_weights(run_dir, own_model.model_dir, 1)
    assert not (snap / "chat_template.jinja").exists()  # what a snapshot lacks
    out = export_hf(snap, own_model.model_dir, tmp_path / "v1", version=1)
    assert os.stat(out / "model.safetensors").st_ino == os.stat(snap / "model.safetensors").st_ino  # no copy
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"  # what the tensors hold
    assert json.loads((own_model.model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == own_model.tokenizer().chat_template
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.float32
    want = load_state_dict(snap)["model.embed_tokens.weight"]
    assert torch.equal(model.get_input_embeddings().weight.detach(), want)
    assert json.loads((out / "dora_export.json").read_text())["version"] == 1


def test_cast_on_export_and_the_final_version(own_model, run_dir, tmp_path):
    out = export_hf(version_weights(run_dir, own_model.model_dir, 2), own_model.model_dir, tmp_path / "bf16",
                    dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_state_dict(out).values()} == {torch.bfloat16}
    assert kept_versions(run_dir) == [0, 1, 2]
    version, final = export_final(run_dir, own_model.model_dir)
    assert version == 2 and final == run_dir / "hf_final" and (final / "chat_template.jinja").is_file()
    with pytest.raises(FileNotFoundError, match=r"no snapshot of version 5 \(kept: 0, 1, 2;"):
        version_weights(run_dir, own_model.model_dir, 5)
    assert version_weights(run_dir, own_model.model_dir, 0) == own_model.model_dir
