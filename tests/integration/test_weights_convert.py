"""HF -> Megatron dist_checkpointing -> HF round trips, bit-exact, in layouts 1, TP=2, PP=2, EP=2
(2 gloo processes each), through the ``dora convert`` / tools code path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dora_megatron.models import hf_model_dir
from dora_megatron.models.presets import preset_config

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = {"1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    cfg = preset_config("tiny-moe")
    cfg["num_hidden_layers"] = 2
    cfg["initializer_range"] = 0.1
    out = tmp_path_factory.mktemp("hf") / "moe"
    hf_model_dir.save_model_dir(out, cfg, hf_model_dir.random_state_dict(cfg, 7))
    (out / "tokenizer.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def round_trips(hf_model, tmp_path_factory):
    """Write one checkpoint per layout, then read all of them back in one 1-rank process."""
    from dora_megatron.trainer.checkpoint_convert import hf_to_megatron, megatron_to_hf_many

    root = tmp_path_factory.mktemp("ckpt")
    pairs = []
    for name, (tp, pp, ep) in LAYOUTS.items():
        if name == "1":  # the tool script path
            subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_hf_to_megatron.py"), "--hf",
                            str(hf_model), "--out", str(root / name)], check=True, capture_output=True, timeout=300)
        else:
            hf_to_megatron(hf_model, root / name, tp=tp, pp=pp, ep=ep, timeout_s=300)
        pairs.append((root / name, root / f"{name}-hf"))
    megatron_to_hf_many(pairs, timeout_s=300)
    return {name: out for name, (_, out) in zip(LAYOUTS, pairs)}, root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_is_bit_exact(hf_model, round_trips, layout):
    outs, root = round_trips
    src = hf_model_dir.load_state_dict(hf_model)
    back = hf_model_dir.load_state_dict(outs[layout])
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (outs[layout] / "config.json").read_text() == (hf_model / "config.json").read_text()
    assert (outs[layout] / "tokenizer.json").is_file()
    import json

    meta = json.loads((root / layout / "dora_convert.json").read_text())
    assert (meta["tp"], meta["pp"], meta["ep"]) == LAYOUTS[layout]
    # a sharded layout really is sharded: the checkpoint has one data file per writing rank
    n_files = len([p for p in (root / layout).iterdir() if p.suffix == ".distcp"])
    assert n_files >= (1 if layout == "1" else 2)


def test_cli_errors(hf_model, round_trips, tmp_path, capsys):
    from dora_megatron.cli import convert

    _, root = round_trips
    rc = convert.main(["hf-to-megatron", "--hf", str(hf_model), "--out", str(root / "tp2")])
    assert rc == 1 and "not empty" in capsys.readouterr().err
    rc = convert.main(["megatron-to-hf", "--ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert rc == 1 and "no checkpoint directory" in capsys.readouterr().err
    rc = convert.main(["megatron-to-hf", "--ckpt", str(root / "tp2"), "--out", str(tmp_path / "o"),
                       "--hf-config", str(tmp_path)])
    assert rc == 1 and "config.json" in capsys.readouterr().err
    assert convert.main(["hf-to-megatron", "--hf", str(hf_model), "--out", str(tmp_path / "x"), "--tp", "0"]) == 2
