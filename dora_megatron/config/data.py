"""Prompt source and reward for the RL job."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dora_megatron.config.base import ConfigError, field_doc

#: Names of the built-in marked-digit tasks: the keys of ``dora_megatron.data.tasks.DIGIT_TASKS``
#: (config imports no component, so the names are spelled here; tests/unit/test_layering.py keeps
#: both equal).
DIGIT_TASK_NAMES = ("digit_cipher", "running_sum")
#: ``data.task`` values that read a prompt dataset from ``data.path`` (``jsonl``: the older name).
DATASET_TASKS = ("dataset", "jsonl")
#: Built-in rewards ``data.reward_fn`` may name instead of ``module:function`` / ``file.py:function``.
BUILTIN_REWARDS = ("math", *DIGIT_TASK_NAMES)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class DataConfig:
    task: str = field_doc("digit_cipher", "Synthetic marked-digit task (`digit_cipher`: each digit through a fixed substitution; `running_sum`: running sum mod 10, much harder for tiny models) or `dataset` for a prompt dataset at `data.path` (`jsonl` is the same).", choices=(*DIGIT_TASK_NAMES, *DATASET_TASKS))
    path: str = field_doc("", "Prompt dataset (task dataset): a `.jsonl`, `.json` or `.parquet` file, a glob of Parquet shards (`data/train-*.parquet`), or a directory written by `datasets.Dataset.save_to_disk`. Read with the `datasets` library; every row is checked at load.")
    eval_path: str = field_doc("", "Eval set, in the formats of `data.path` (read, checked and rendered the same way, fields by the same keys, scored by the same reward): each prompt is answered `observability.eval_samples` times on the rollout engines every `observability.eval_interval` steps and at the end; mean reward, pass@1 and pass@k go to TensorBoard (`eval/...`), `eval.jsonl` and `summary.json`. Empty: no eval set.")
    prompt_key: str = field_doc("prompt", "Field of a row holding the prompt (dotted path into nested fields): a string, or a chat message list (`[{role, content}, ...]`, verl/DAPO layout).")
    answer_key: str = field_doc("reward_model.ground_truth", "Field of a row holding the ground truth handed to the reward (dotted path; verl/DAPO layout by default). The row's `data_source` and `extra_info` reach the reward too.")
    apply_chat_template: str | bool = field_doc("auto", "Render prompts with the tokenizer's chat template (transformers' `apply_chat_template`, with the generation prompt): `auto` when the tokenizer has one, `true` (refused without one) or `false` (plain text; a message list must then be one user message).", choices=("auto", True, False))
    system_prompt: str = field_doc("", "System message put before plain-string prompts (chat template on); message-list prompts bring their own.")
    chat_template_kwargs: dict[str, Any] = field_doc(default_factory=dict, doc="Extra variables of the chat template, e.g. `{enable_thinking: false}` for Qwen3.")
    shuffle: bool = field_doc(True, "Dataset: visit the rows in a new order each epoch (a permutation drawn from `data.seed` and the epoch number).")
    epochs: int = field_doc(0, "Dataset: passes over the rows (0 = endless). Refused at load when `run.steps * orchestrator.tbs` groups need more prompts than that.", ge=0)
    skip_bad_rows: bool = field_doc(False, "Dataset: skip rows that cannot be used (missing field, wrong type, prompt too long for `trainer.max_seq_len - rollout.max_new_tokens`) and count them (`summary.json` `data_skipped_rows`) instead of refusing the file at load.")
    reward_fn: str = field_doc("", "Reward: `package.module:function` or `path/to/file.py:function` with verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` (sync or async; a float or a dict with `score`), or a built-in: `math`, `digit_cipher`, `running_sum`. Empty: the task's own (`math` for a dataset).")
    reward_workers: int = field_doc(2, "Worker processes running a `module:function` / file reward (and `math`) off the controller.", ge=1)
    reward_timeout_s: float = field_doc(30.0, "A reward call longer than this is reward 0 with an error; its worker is replaced.", gt=0.0, unit="s")
    min_len: int = field_doc(1, "Digit tasks: shortest digit list.", ge=1)
    max_len: int = field_doc(40, "Digit tasks: longest digit list (at most 52: one position marker per digit).", ge=1, le=52)
    length_exponent: float = field_doc(1.6, "Digit tasks: list length n is drawn with p(n) ~ n^-exponent (heavy tail).", gt=0.0)
    partial_credit: bool = field_doc(False, "Digit tasks: reward wrong answers with half the fraction of correct leading characters instead of 0.")
    seed: int = field_doc(0, "Seed of the prompt stream and of the dataset's per-epoch shuffle (independent of the run seed so baselines see the same prompts).", ge=0)

    @property
    def is_dataset(self) -> bool:
        return self.task in DATASET_TASKS

    def check(self, path: str) -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"{path}.max_len", f"must be >= min_len ({self.min_len}), got {self.max_len}")
        if self.is_dataset and not self.path:
            raise ConfigError(f"{path}.path", f"required when task is {self.task!r}")
        if self.system_prompt and self.apply_chat_template is False:
            raise ConfigError(f"{path}.system_prompt", "needs a chat template to be put in the prompt "
                              "(data.apply_chat_template is false)")
        if self.chat_template_kwargs and self.apply_chat_template is False:
            raise ConfigError(f"{path}.chat_template_kwargs", "are variables of the chat template, which "
                              "data.apply_chat_template: false turns off")
        problem = reward_spec_problem(self.reward_fn)
        if problem:
            raise ConfigError(f"{path}.reward_fn", problem)


def reward_spec_problem(spec: str) -> str | None:
    """Why ``spec`` is not a reward name ``data.reward_fn`` accepts (its syntax only), or None."""
    if not spec or spec in BUILTIN_REWARDS:
        return None
    target, sep, fn = spec.rpartition(":")
    if not sep or not target or not _IDENT.match(fn):
        return (f"{spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'package.module:function' / "
                "'path/to/file.py:function'")
    if not target.endswith(".py") and not all(_IDENT.match(p) for p in target.split(".")):
        return f"{target!r} is neither a module name (package.module) nor a .py file"
    return None
