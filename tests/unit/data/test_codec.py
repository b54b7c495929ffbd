"""Controller-side tokenization: char vocabulary for init-model dirs, tokenizer.json otherwise."""

from __future__ import annotations

import json

import pytest

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.codec import CharCodec, HFTokenizerCodec, load_codec


def test_char_codec_for_init_model_dirs(tmp_path):
    tok.save_tokenizer(tmp_path)
    codec = load_codec(tmp_path)
    assert isinstance(codec, CharCodec)
    ids = codec.encode_prompt("a3b1:")
    assert ids[0] == tok.BOS_ID and codec.decode(ids) == "a3b1:" and codec.eos_ids == [tok.EOS_ID]


def test_hf_tokenizer_codec(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|end|>": 1, "hello": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<|end|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    codec = load_codec(tmp_path)
    assert isinstance(codec, HFTokenizerCodec)
    assert codec.encode_prompt("hello world") == [2, 3]
    assert codec.decode([2, 1, 3]) == "hello world"
    assert codec.eos_ids == [1, 3]


def test_missing_tokenizer_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_codec(tmp_path)
