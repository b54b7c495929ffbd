"""The prompt source, the renderer and the reward scorer of a job, built from its config: one
factory for every user.

Why one factory: the controller, the capacity pass of ``dora bench`` and the input check before a
job starts must see the same prompts rendered the same way and scored by the same reward (DESIGN
section 13); each calls :func:`job_codec`, :func:`prompt_source` and :func:`make_scorer` instead of
reading ``data.*`` itself.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from dora_megatron.data.codec import CharCodec, RenderOptions, TextCodec, load_codec
from dora_megatron.data.reward_api import RewardScorer

log = logging.getLogger(__name__)


def job_codec(cfg: Any, model_dir: str | Path | None) -> TextCodec:
    """The renderer of ``model_dir`` (the char vocabulary of the presets when None) with the
    ``data.*`` rendering options."""
    options = RenderOptions.from_config(cfg.data)
    return load_codec(model_dir, options) if model_dir else CharCodec(options)


def max_prompt_tokens(cfg: Any) -> int:
    """The longest prompt a sample can have: ``trainer.max_seq_len - rollout.max_new_tokens``."""
    return cfg.trainer.max_seq_len - cfg.rollout.max_new_tokens


def prompt_source(cfg: Any, codec: TextCodec):
    """``data``: the digit task, or the dataset at ``data.path`` checked whole (every row parsed and
    rendered by ``codec`` within :func:`max_prompt_tokens`). Raises ValueError / FileNotFoundError
    naming ``data.path`` (and the file and row) or the ``data.*`` key at fault."""
    d = cfg.data
    if not d.is_dataset:
        from dora_megatron.data.tasks import RunningSumTask

        return RunningSumTask(d.min_len, d.max_len, d.length_exponent, seed=d.seed, kind=d.task)
    from dora_megatron.data.dataset import DatasetPromptSource, RowFields

    source = DatasetPromptSource.load(d.path, codec, fields=RowFields(d.prompt_key, d.answer_key),
                                      max_prompt_tokens=max_prompt_tokens(cfg), skip_bad_rows=d.skip_bad_rows,
                                      seed=d.seed, shuffle=d.shuffle, epochs=d.epochs)
    needed = cfg.run.steps * cfg.orchestrator.tbs
    if source.total is not None and source.total < needed:
        raise ValueError(f"data.epochs: {d.epochs} epoch(s) of {len(source)} usable rows are {source.total} prompts; "
                         f"run.steps={cfg.run.steps} x orchestrator.tbs={cfg.orchestrator.tbs} needs at least "
                         f"{needed} (more epochs, or 0 for endless)")
    return source


def eval_prompts(cfg: Any, codec: TextCodec) -> list | None:
    """The eval set of ``data.eval_path`` (None when empty): every usable row once, in file order,
    read, checked and rendered as the training prompts are (the same loader, fields, renderer and
    length limit; ``data.skip_bad_rows`` applies). Errors name ``data.eval_path`` and the row."""
    d = cfg.data
    if not d.eval_path:
        return None
    from dora_megatron.data.dataset import DatasetPromptSource, RowFields

    source = DatasetPromptSource.load(d.eval_path, codec, fields=RowFields(d.prompt_key, d.answer_key),
                                      max_prompt_tokens=max_prompt_tokens(cfg), skip_bad_rows=d.skip_bad_rows,
                                      shuffle=False, epochs=1, key="data.eval_path")
    return [source.get(i) for i in range(len(source))]


def skipped_rows(source: Any) -> int:
    """Rows ``data.skip_bad_rows`` left out (0 for the digit tasks): ``summary.json`` ``data_skipped_rows``."""
    return len(getattr(source, "skipped", ()))


def reward_name(data: Any) -> str:
    """What ``data.reward_fn`` resolves to: the spec, or the task's own built-in when it is empty."""
    from dora_megatron.data.tasks import DIGIT_TASKS

    return data.reward_fn or (data.task if data.task in DIGIT_TASKS else "math")


def make_scorer(data: Any) -> tuple[RewardScorer, str]:
    """The scorer of ``data`` (a ``DataConfig``) and the reward in words (``summary.json`` ``reward_fn``).
    Worker processes start here, and a function that cannot be loaded raises :class:`RewardLoadError`."""
    from dora_megatron.data.reward_api import ThreadScorer
    from dora_megatron.data.reward_workers import ProcessScorer
    from dora_megatron.data.rewards import MATH_SPEC
    from dora_megatron.data.tasks import DIGIT_TASKS, math_verify_available, reward_description, running_sum_reward

    name = reward_name(data)
    if name in DIGIT_TASKS:
        return (ThreadScorer(functools.partial(running_sum_reward, partial_credit=data.partial_credit)),
                reward_description(name, data.partial_credit))
    if name == "math":
        if not math_verify_available():
            log.warning("reward math: math-verify cannot be imported; the built-in final-answer match is used "
                        "(pip install math-verify for symbolic equivalence)")
        return ProcessScorer(MATH_SPEC, data.reward_workers, data.reward_timeout_s), reward_description("math")
    scorer = ProcessScorer(name, data.reward_workers, data.reward_timeout_s)
    return scorer, (f"{name} (verl compute_score, {data.reward_workers} worker process(es), "
                    f"{data.reward_timeout_s:g} s limit)")
