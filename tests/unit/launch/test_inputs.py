"""Job inputs are checked before any process starts: the model directory and a JSONL prompt file
(read whole, every prompt encodable by the model's tokenizer), each problem named."""

from __future__ import annotations

import json
from pathlib import Path

from dora_megatron.config.schema import load_config
from dora_megatron.launch.inputs import input_problem

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"


def jsonl_cfg(path):
    return load_config(str(CONFIG), ["data.task=jsonl", f"data.path={path}", "model.warm_start="])


def test_good_prompt_file_passes(tmp_path):
    f = tmp_path / "math.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"What is {a}+{a}?", "answer": str(2 * a)}) for a in range(5)))
    assert input_problem(jsonl_cfg(f)) is None


def test_prompt_file_problems_are_named(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert input_problem(jsonl_cfg(missing)) == f"data.path: no such file {missing}"
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n{oops\n")
    assert input_problem(jsonl_cfg(f)).startswith(f"data.path: {f}:2: invalid JSON")
    f.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    assert input_problem(jsonl_cfg(f)) == f"data.path: {f}:1: missing field 'answer'"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "π/2?", "answer": "1"}))
    problem = input_problem(jsonl_cfg(f))
    assert problem.startswith(f"data.path: {f}: prompt 2: the model's tokenizer cannot encode it") and "'π'" in problem


def test_model_path_is_checked_first(tmp_path):
    cfg = load_config(str(CONFIG), ["model.warm_start=", f"model.path={tmp_path / 'none'}"])
    assert input_problem(cfg) == f"model.path: {tmp_path / 'none'} is not a directory"


def test_model_config_is_read_as_transformers_reads_it(tmp_path):
    """``model.path``'s config.json goes through transformers' config class before anything starts:
    a value it refuses is named with the file and the field (it used to surface when the engines loaded)."""
    from dora_megatron.models.presets import create_model_dir

    d = create_model_dir("tiny-moe", tmp_path / "m", seed=0)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": "two"}))
    cfg = load_config(str(CONFIG), ["model.warm_start=", f"model.path={d}"])
    problem = input_problem(cfg)
    assert problem.startswith(f"model.path: {d / 'config.json'}: transformers") and "num_experts_per_tok" in problem
