"""The user's own model and data at toy size, built once per test session (``own_model`` fixture).

What a user brings, in the shapes they bring it (DESIGN section 13): a tiny Qwen3-MoE saved by
transformers with a byte-level BPE tokenizer, ``<|im_start|>`` / ``<|im_end|>`` and a Qwen-style chat
template, a ``generation_config.json``; a DAPO-shaped Parquet file written with pyarrow; the
verl-style reward file ``examples/own_model/reward.py``. Built by the same code as
``tools/make_example_model.py`` (:mod:`dora_megatron.models.example`), in a few seconds.

Tests must not write into these directories (they are shared by the session): copy first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REWARD_FILE = ROOT / "examples" / "own_model" / "reward.py"


@dataclass(frozen=True)
class OwnModel:
    root: Path
    model_dir: Path  # config.json, model.safetensors, tokenizer files, chat_template.jinja, generation_config.json
    data: Path  # train.parquet: chat-list prompt (system + user), reward_model.ground_truth, data_source, extra_info
    reward_file: Path

    @property
    def reward_fn(self) -> str:
        """``data.reward_fn`` of the example reward."""
        return f"{self.reward_file}:compute_score"

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))


def build_own_model(root: str | Path, rows: int = 64) -> OwnModel:
    from dora_megatron.models.example import write_example

    paths = write_example(root, rows=rows)
    return OwnModel(Path(root), paths.model_dir, paths.data, REWARD_FILE)
