"""Prompt source and reward for the RL job."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc

#: Names of the built-in marked-digit tasks: the keys of ``dora_megatron.data.tasks.DIGIT_TASKS``
#: (config imports no component, so the names are spelled here; tests/unit/test_layering.py keeps
#: both equal).
DIGIT_TASK_NAMES = ("digit_cipher", "running_sum")


@dataclass
class DataConfig:
    task: str = field_doc("digit_cipher", "Synthetic marked-digit task (`digit_cipher`: each digit through a fixed substitution; `running_sum`: running sum mod 10, much harder for tiny models) or `jsonl` for a prompt dataset file.", choices=(*DIGIT_TASK_NAMES, "jsonl"))
    path: str = field_doc("", "JSONL file with `prompt` and `answer` fields (DAPO-Math-17k layout); required when task is jsonl.")
    prompt_key: str = field_doc("prompt", "JSONL field holding the prompt text.")
    answer_key: str = field_doc("answer", "JSONL field holding the ground-truth answer.")
    min_len: int = field_doc(1, "Digit tasks: shortest digit list.", ge=1)
    max_len: int = field_doc(40, "Digit tasks: longest digit list (at most 52: one position marker per digit).", ge=1, le=52)
    length_exponent: float = field_doc(1.6, "Digit tasks: list length n is drawn with p(n) ~ n^-exponent (heavy tail).", gt=0.0)
    partial_credit: bool = field_doc(False, "Digit tasks: reward wrong answers with half the fraction of correct leading characters instead of 0.")
    seed: int = field_doc(0, "Seed of the prompt stream (independent of the run seed so baselines see the same prompts).", ge=0)

    def check(self, path: str) -> None:
        if self.max_len < self.min_len:
            raise ConfigError(f"{path}.max_len", f"must be >= min_len ({self.min_len}), got {self.max_len}")
        if self.task == "jsonl" and not self.path:
            raise ConfigError(f"{path}.path", "required when task is 'jsonl'")
