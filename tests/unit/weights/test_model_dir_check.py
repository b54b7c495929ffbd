"""``check_model_dir``: every problem of an HF directory that would stop a job, named up front."""

from __future__ import annotations

import json

from dora_megatron.models.hf_model_dir import check_model_dir
from dora_megatron.models.presets import create_model_dir


def test_a_created_model_directory_is_usable(tmp_path):
    assert check_model_dir(create_model_dir("tiny-moe", tmp_path / "m", seed=0)) == []


def test_each_problem_is_named(tmp_path):
    d = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    (d / "model.safetensors").unlink()
    (d / "tokenizer.json").unlink()
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    problems = check_model_dir(d)
    assert len(problems) == 3
    assert "model_type 'llama' is not supported (supported: qwen3, qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3)" in problems[0]
    assert "no model.safetensors or model.safetensors.index.json" in problems[1]
    assert "no tokenizer.json" in problems[2]
    assert check_model_dir(d, need_tokenizer=False) == problems[:2]
    (d / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in check_model_dir(d)[0]
    assert check_model_dir(tmp_path / "absent") == [f"{tmp_path / 'absent'} is not a directory"]
