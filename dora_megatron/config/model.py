"""Which policy model to train and serve (a Hugging Face format directory)."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc
from dora_megatron.config.data import DIGIT_TASK_NAMES


@dataclass
class ModelConfig:
    path: str = field_doc("", "Hugging Face format model directory (config.json + safetensors). Empty = create it from `preset` inside the run directory.")
    preset: str = field_doc("tiny-moe", "Preset used when `path` is empty (`dora init-model --preset`).", choices=("tiny-moe", "tiny-dense"))
    warm_start: str = field_doc("", "When the model is created from a preset: supervised warm start on this digit task first (empty = random init).", choices=("", *DIGIT_TASK_NAMES))
    warm_start_steps: int = field_doc(600, "Optimizer steps of the supervised warm start.", ge=0)

    def check(self, path: str) -> None:
        if self.warm_start and self.path:
            raise ConfigError(f"{path}.warm_start", "only applies when the model is created from `preset` (model.path must "
                              "be empty); for a model directory of your own start from configs/cpu_own_model.yaml, "
                              "or add --set model.warm_start=")
