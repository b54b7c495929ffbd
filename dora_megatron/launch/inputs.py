"""Checks of a job's inputs that run before any process starts or any run directory is written.

Why: a model directory without a tokenizer or a prompt file with one unencodable line would
otherwise surface minutes later, as a traceback from the controller after the engines and the
trainer are up (or mid-run, when that prompt's turn comes). Each check returns the problems in
words that name the config key and the file.
"""

from __future__ import annotations

from pathlib import Path

from dora_megatron.config.schema import DoraConfig


def model_path_problem(cfg: DoraConfig) -> str | None:
    """Why ``model.path`` (when set) cannot run a job, or None; checked before anything starts."""
    from dora_megatron.models.hf_model_dir import check_model_dir

    problems = check_model_dir(Path(cfg.model.path).resolve()) if cfg.model.path else []
    return "model.path: " + "; ".join(problems) if problems else None


def input_problem(cfg: DoraConfig) -> str | None:
    """Why the job's inputs cannot run it, or None: ``model.path`` and, for ``data.task: jsonl``, the
    prompt file read whole and every prompt encoded with the model's tokenizer (a bad line would
    otherwise stop the run when its turn comes, engines and trainer already up)."""
    from dora_megatron.launch.layout import trainer_layout_problem

    problem = model_path_problem(cfg) or trainer_layout_problem(cfg)
    if not problem and cfg.rollout.engine == "vllm":
        from dora_megatron.rollout.vllm.launch import vllm_problem

        problem = vllm_problem(cfg)
    if problem or cfg.data.task != "jsonl":
        return problem
    from dora_megatron.data.codec import CharCodec, load_codec
    from dora_megatron.data.tasks import JsonlPromptSource

    d = cfg.data
    try:
        source = JsonlPromptSource(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key)
    except (OSError, ValueError) as err:
        return str(err) if str(err).startswith("data.path") else f"data.path: {err}"
    codec = load_codec(cfg.model.path) if cfg.model.path else CharCodec()  # presets use the char vocabulary
    for i, (prompt, _) in enumerate(source.items):
        try:
            codec.encode_prompt(prompt)
        except ValueError as err:
            return f"data.path: {d.path}: prompt {i + 1}: the model's tokenizer cannot encode it: {err}"
    return None
