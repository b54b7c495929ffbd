"""Text <-> token ids for the controller: the project's char tokenizer or any HF ``tokenizer.json``.

Why a seam here: engines speak token ids only (SGLang with ``--skip-tokenizer-init``),
so the controller tokenizes prompts and detokenizes responses for the reward. The
tiny models use the fixed character vocabulary of :mod:`dora_megatron.data.tokenizer`;
a real Qwen3 checkpoint brings its own ``tokenizer.json`` and EOS ids from
``config.json`` / ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence

from dora_megatron.data import tokenizer as tok


class TextCodec(Protocol):
    eos_ids: list[int]

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharCodec:
    """The project's character vocabulary (ids fixed in :mod:`dora_megatron.data.tokenizer`)."""

    eos_ids = [tok.EOS_ID]

    def encode_prompt(self, text: str) -> list[int]:
        return tok.encode(text, add_bos=True)

    def decode(self, ids: Sequence[int]) -> str:
        return tok.decode(ids)


class HFTokenizerCodec:
    """A Hugging Face ``tokenizers`` tokenizer loaded from ``tokenizer.json``."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / tok.TOKENIZER_FILE))
        config = _read_json(model_dir / "config.json")
        gen = _read_json(model_dir / "generation_config.json")
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        self.eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.bos_id = config.get("bos_token_id")

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_codec(model_dir: str | Path) -> TextCodec:
    """The char codec for directories made by ``dora init-model``, else the directory's tokenizer."""
    model_dir = Path(model_dir)
    path = model_dir / tok.TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model.path: no {tok.TOKENIZER_FILE} in {model_dir} (engines take token ids; "
                                "the controller needs the tokenizer)")
    vocab = json.loads(path.read_text()).get("model", {}).get("vocab", {})
    if isinstance(vocab, dict) and vocab == tok.vocab():
        return CharCodec()
    return HFTokenizerCodec(model_dir)
