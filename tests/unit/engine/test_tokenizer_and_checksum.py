"""Tokenizer ids agree with the saved tokenizer.json; the weights checksum is order-free and sensitive."""

from __future__ import annotations

import pytest
import torch

from dora_megatron.data import tokenizer as tok
from dora_megatron.comm.checksum import weights_checksum


def test_encode_matches_saved_tokenizer(tmp_path):
    tok.save_tokenizer(tmp_path)
    t = tok.load_tokenizer(tmp_path)
    text = "Sum: 1 2 3 = 6 ~!{}"
    assert t.encode(text).ids == tok.encode(text)
    assert t.get_vocab_size() == tok.VOCAB_SIZE
    assert t.token_to_id("<eos>") == tok.EOS_ID and t.token_to_id("<pad>") == tok.PAD_ID
    assert t.decode(tok.encode(text)) == text


def test_prompt_whitespace_and_typographic_punctuation_are_mapped_to_ascii(tmp_path):
    """A DAPO-Math-17k style prompt: lines, a tab, curly quotes, an en dash, an ellipsis, math signs."""
    text = "Solve:\n\tLet \u201cx\u201d be 2\u20133\u2026 \u2018y\u2019 \u2264 3\u00d74 \u2212 1"
    ascii_text = 'Solve:  Let "x" be 2-3... \'y\' <= 3*4 - 1'
    assert tok.encode(text) == tok.encode(ascii_text)
    tok.save_tokenizer(tmp_path)
    assert tok.load_tokenizer(tmp_path).encode(text).ids == tok.encode(text)  # tokenizer.json agrees


def test_decode_roundtrip_and_specials():
    text = "".join(chr(c) for c in range(32, 127))
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.BOS_ID and len(set(ids)) == len(ids) and max(ids) < tok.VOCAB_SIZE
    assert tok.decode(ids + [tok.EOS_ID]) == text
    assert tok.decode([tok.EOS_ID], skip_special=False) == "<eos>"


def test_encode_rejects_non_ascii():
    with pytest.raises(ValueError, match="position 1 .*model.path with a tokenizer.json"):
        tok.encode("a\u00e9")


def test_checksum_independent_of_insertion_order():
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    b = {"y": torch.ones(2, 2), "x": torch.arange(4.0)}
    assert weights_checksum(a) == weights_checksum(b)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.__setitem__("x", d["x"] + 1e-6),
        lambda d: d.__setitem__("x", d["x"].double()),
        lambda d: d.__setitem__("y", d["y"].reshape(4)),
        lambda d: d.__setitem__("z", d.pop("y")),
    ],
)
def test_checksum_changes_with_values_dtype_shape_name(change):
    base = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    other = dict(base)
    change(other)
    assert weights_checksum(base) != weights_checksum(other)


def test_checksum_handles_bf16_and_noncontiguous():
    t = torch.randn(4, 6).to(torch.bfloat16)
    assert weights_checksum({"w": t.t()}) == weights_checksum({"w": t.t().contiguous()})
