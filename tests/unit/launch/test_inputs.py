"""Job inputs are checked before any process starts: the model directory, a prompt dataset (read
whole, every row parsed and rendered by the model's tokenizer within the trainer's length), the
rendering options against the tokenizer, and a reward function of the user's; each problem named."""

from __future__ import annotations

import json
from pathlib import Path

from dora_megatron.config.schema import load_config
from dora_megatron.launch.inputs import input_problem

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
OWN = Path(__file__).resolve().parents[3] / "configs" / "cpu_own_model.yaml"


def jsonl_cfg(path, *more):
    return load_config(str(CONFIG), ["data.task=dataset", f"data.path={path}", "data.answer_key=answer",
                                     "model.warm_start=", *more])


def own_cfg(own_model, *more):
    return load_config(str(OWN), [f"model.path={own_model.model_dir}", f"data.path={own_model.data}",
                                  f"data.reward_fn={own_model.reward_fn}", "data.reward_workers=1", *more])


def test_good_prompt_file_passes(tmp_path):
    f = tmp_path / "math.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"What is {a}+{a}?", "answer": str(2 * a)}) for a in range(5)))
    assert input_problem(jsonl_cfg(f)) is None


def test_prompt_file_problems_are_named(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert input_problem(jsonl_cfg(missing)) == f"data.path: no such file {missing}"
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n{oops\n")
    assert input_problem(jsonl_cfg(f)).startswith(f"data.path: {f}: not readable as json")
    f.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    assert input_problem(jsonl_cfg(f)).startswith(f"data.path: {f} row 0: missing field 'answer' (data.answer_key)")
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "\u03c0/2?", "answer": "1"}))
    problem = input_problem(jsonl_cfg(f))
    assert problem.startswith(f"data.path: {f} row 1: the prompt cannot be rendered for the model") and "'\u03c0'" in problem
    assert input_problem(jsonl_cfg(f, "data.skip_bad_rows=true")) is None


def test_the_own_model_config_checks_template_data_and_reward(own_model, tmp_path):
    assert input_problem(own_cfg(own_model)) is None
    assert input_problem(own_cfg(own_model, "rollout.max_new_tokens=4000", "trainer.max_seq_len=4020")).startswith(
        f"data.path: {own_model.data} row 0: the rendered prompt is ")
    bare = tmp_path / "no_template"
    bare.mkdir()
    for f in own_model.model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    problem = input_problem(own_cfg(own_model, f"model.path={bare}"))
    assert problem.startswith(f"data.path: {own_model.data} row 0: the prompt cannot be rendered") and \
        "chat of 2 messages (system, user)" in problem  # a system turn is never silently dropped
    assert input_problem(own_cfg(own_model, f"model.path={bare}", "data.apply_chat_template=true")).startswith(
        "data.apply_chat_template: true, but the tokenizer")
    assert input_problem(own_cfg(own_model, f"data.reward_fn={own_model.reward_file}:nope")).startswith(
        f"data.reward_fn: {own_model.reward_file} has no function 'nope'")


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
