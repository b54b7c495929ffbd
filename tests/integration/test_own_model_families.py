"""A user's own model of each family beyond Qwen3-MoE, made by ``tools/make_example_model.py
--family`` (transformers' classes, bf16, tokenizer and chat template), through ``dora train --config
configs/cpu_own_model.yaml`` for 3 steps with routing replay on: nothing lost, every step replays
the engine's experts, and the exported ``hf_final`` is the trained model that transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"])
def test_own_model_of_the_family_trains_three_steps_with_routing_replay(tmp_path, family):
    from safetensors.torch import load_file

    ex = tmp_path / "ex"
    _run("tools/make_example_model.py", "--out", str(ex), "--rows", "32", "--family", family)
    assert json.loads((ex / "model" / "config.json").read_text())["model_type"] == family
    run_dir = tmp_path / "run"
    overrides = [f"model.path={ex / 'model'}", f"data.path={ex / 'train.parquet'}", f"run.run_dir={run_dir}",
                 "run.steps=3", "algo.routing_replay=true", "observability.progress=false",
                 "observability.timeline=false"]
    _run("-m", "dora_megatron", "train", "--config", str(ROOT / "configs" / "cpu_own_model.yaml"),
         *[x for o in overrides for x in ("--set", o)])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["routing_replay_steps"] == 3
    final = Path(summary["hf_final"])
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert type(hf).__name__ == json.loads((ex / "model" / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    before, after = load_file(str(ex / "model" / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert sorted(after) == sorted(before)
    assert any(not torch.equal(after[k].float(), before[k].float()) for k in before)  # the steps trained it
