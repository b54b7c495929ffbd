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
    if not problems and cfg.model.path and cfg.rollout.engine in ("sglang", "vllm"):
        problems = fp8_engine_problem(Path(cfg.model.path).resolve(), cfg.rollout.engine)
    return "model.path: " + "; ".join(problems) if problems else None


def fp8_engine_problem(model_dir: Path, engine: str) -> list[str]:
    """An FP8 checkpoint cannot start external engines: they would load it as FP8 and then be sent
    the trainer's full-precision weights. The trainer and the embedded engine dequantize it."""
    from dora_megatron.models.fp8_checkpoint import QUANT_KEY, fp8_block
    from dora_megatron.models.hf_model_dir import load_config

    if fp8_block(load_config(model_dir), str(model_dir)) is None:
        return []
    return [f"{model_dir} is a block-FP8 checkpoint ({QUANT_KEY}); rollout.engine {engine!r} would serve it as FP8 "
            "while dora sends full-precision weights: write a full-precision copy first (`dora convert "
            "hf-to-megatron`, then `dora convert megatron-to-hf`), or use rollout.engine: embedded"]


def input_problem(cfg: DoraConfig) -> str | None:
    """Why the job's inputs cannot run it, or None: ``model.path``, the rendering options against
    the model's tokenizer, a prompt dataset read whole (every row parsed and rendered within
    ``trainer.max_seq_len - rollout.max_new_tokens``: a bad row would otherwise stop the run when its
    turn comes, engines and trainer already up), the eval set (``data.eval_path``, the same checks)
    and a ``data.reward_fn`` of the user's (loaded by a
    worker process, as the run will)."""
    from dora_megatron.launch.layout import trainer_layout_problem

    problem = model_path_problem(cfg) or trainer_layout_problem(cfg)
    if not problem and cfg.rollout.engine == "vllm":
        from dora_megatron.rollout.vllm.launch import vllm_problem

        problem = vllm_problem(cfg)
    if problem:
        return problem
    from dora_megatron.data.sources import eval_prompts, job_codec, prompt_source

    try:
        codec = job_codec(cfg, cfg.model.path or None)  # presets use the char vocabulary
        if cfg.data.is_dataset:
            prompt_source(cfg, codec)
        eval_prompts(cfg, codec)  # data.eval_path, the same checks
    except (OSError, ValueError) as err:
        return str(err) if str(err).startswith("data.") else f"data.path: {err}"
    return reward_problem(cfg)


def reward_problem(cfg: DoraConfig) -> str | None:
    """Why ``data.reward_fn`` (a function of the user's) cannot be loaded, or None: one worker
    process loads it as the run's workers will."""
    from dora_megatron.config.data import BUILTIN_REWARDS

    spec = cfg.data.reward_fn
    if not spec or spec in BUILTIN_REWARDS:
        return None
    from dora_megatron.data.reward_workers import ProcessScorer
    from dora_megatron.data.rewards import RewardLoadError

    try:
        ProcessScorer(spec, workers=1).close()
    except RewardLoadError as err:
        return str(err)
    return None
