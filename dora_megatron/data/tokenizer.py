"""Character-level tokenizer shared by the synthetic tasks, the engine tooling and the trainer.

Why character level: the synthetic tasks (digit lists, running sums) are short strings over
printable ASCII, so one token per character keeps prompts and answers trivially aligned and
lets every component agree on ids without a trained vocabulary. The ids are fixed:
``<pad>``=0, ``<bos>``=1, ``<eos>``=2, then printable ASCII 32..126 in order (ids 3..97), then
unused filler tokens up to :data:`VOCAB_SIZE` (128) so the embedding size is a round number.

Real prompt sets (DAPO-Math-17k) are not pure printable ASCII: they carry newlines, tabs and
typographic punctuation. Those characters are mapped to ASCII before encoding (:data:`ASCII_MAP`:
whitespace to a space, curly quotes, dashes, the ellipsis, math signs such as ``×`` and ``≤``),
in :func:`encode` and in the saved ``tokenizer.json`` (as its normalizer) alike, so the ids stay
the same for both. Anything else (letters outside ASCII) is refused with what to do instead.

The module imports only the standard library at import time; :func:`build_tokenizer` and
:func:`load_tokenizer` import the ``tokenizers`` library lazily. :func:`encode` / :func:`decode`
are pure Python and give exactly the ids of the saved ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
FIRST_CHAR = 32
LAST_CHAR = 126
CHAR_OFFSET = 3 - FIRST_CHAR  # id = ord(ch) + CHAR_OFFSET
VOCAB_SIZE = 128
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
TOKENIZER_FILE = "tokenizer.json"


#: characters outside printable ASCII that real prompt sets use, and their ASCII replacement
ASCII_MAP: dict[str, str] = {
    **{ws: " " for ws in "\n\r\t\v\f\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"},
    "\u200b": "", "\ufeff": "",  # zero-width space, byte-order mark
    **{q: "'" for q in "\u2018\u2019\u201a\u201b\u2032"},
    **{q: '"' for q in "\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb"},
    **{d: "-" for d in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"},
    "\u2026": "...", "\u00d7": "*", "\u22c5": "*", "\u00b7": "*", "\u00f7": "/",
    "\u2264": "<=", "\u2265": ">=", "\u2260": "!=", "\u2248": "~",
}
UNENCODABLE_HINT = ("the preset character vocabulary is printable ASCII (newline, tab and common Unicode "
                    "punctuation are mapped to ASCII); use a model with its own tokenizer (model.path with a "
                    "tokenizer.json) or remove the character from the prompts")


def vocab() -> dict[str, int]:
    """The full token -> id table (specials, printable ASCII, unused fillers up to VOCAB_SIZE)."""
    table: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for code in range(FIRST_CHAR, LAST_CHAR + 1):
        table[chr(code)] = code + CHAR_OFFSET
    next_id = len(table)
    while next_id < VOCAB_SIZE:
        table[f"<unused_{next_id}>"] = next_id
        next_id += 1
    return table


def encode(text: str, add_bos: bool = False) -> list[int]:
    """Map ``text`` to ids (through :data:`ASCII_MAP`); raises ValueError naming the first character
    that is neither printable ASCII nor mapped, and what to do about it."""
    ids = [BOS_ID] if add_bos else []
    for pos, ch in enumerate(text):
        for c in ASCII_MAP.get(ch, ch):
            code = ord(c)
            if code < FIRST_CHAR or code > LAST_CHAR:
                raise ValueError(f"character {ch!r} at position {pos} is not in the vocabulary: {UNENCODABLE_HINT}")
            ids.append(code + CHAR_OFFSET)
    return ids


def decode(ids: Iterable[int], skip_special: bool = True) -> str:
    """Map ids back to text; special and unused ids are dropped when ``skip_special``. The
    id -> token table is built only when specials are kept (the controller decodes every finished
    sample: rebuilding it each time cost a few per cent of the controller's CPU when measured)."""
    inverse = {} if skip_special else {i: tok for tok, i in vocab().items()}
    out = []
    for i in ids:
        i = int(i)
        if FIRST_CHAR + CHAR_OFFSET <= i <= LAST_CHAR + CHAR_OFFSET:
            out.append(chr(i - CHAR_OFFSET))
        elif not skip_special:
            out.append(inverse.get(i, f"<id_{i}>"))
    return "".join(out)


def build_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` whose ids equal :func:`encode` (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Replace(src, dst) for src, dst in ASCII_MAP.items()])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(model_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` (plus a minimal ``tokenizer_config.json``) into ``model_dir``."""
    import json

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / TOKENIZER_FILE
    build_tokenizer().save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD_TOKEN,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_tokenizer(model_dir: str | Path) -> Any:
    """Load ``tokenizer.json`` from a model directory as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir}")
    return Tokenizer.from_file(str(path))
