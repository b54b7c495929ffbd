"""Prompt rendering: the char vocabulary for init-model dirs, a model's own tokenizer and chat template
otherwise (transformers' ``apply_chat_template``: the whole message list, the generation prompt,
the template's variables), stop ids from generation_config.json, responses decoded without
special tokens."""

from __future__ import annotations

import json

import pytest

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.codec import CharCodec, HFTokenizerCodec, RenderOptions, load_codec
from dora_megatron.data.tasks import Prompt

CHAT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"})


def test_char_codec_for_init_model_dirs(tmp_path):
    tok.save_tokenizer(tmp_path)
    codec = load_codec(tmp_path)
    assert isinstance(codec, CharCodec)
    ids = codec.encode_prompt("a3b1:")
    assert ids[0] == tok.BOS_ID and codec.decode(ids) == "a3b1:" and codec.eos_ids == [tok.EOS_ID]
    assert codec.encode_prompt(Prompt(0, "a3b1:", "x")) == ids  # a Prompt renders as its text


def test_char_codec_takes_one_user_message_and_refuses_to_drop_turns():
    codec = CharCodec()
    one = Prompt(0, "", "4", messages=({"role": "user", "content": "2+2?"},))
    assert codec.encode_prompt(one) == tok.encode("2+2?", add_bos=True)
    with pytest.raises(ValueError, match=r"chat of 2 messages \(system, user\).*without dropping turns"):
        codec.encode_prompt(Prompt(0, "", "5", messages=CHAT))
    with pytest.raises(ValueError, match="data.apply_chat_template: true"):
        CharCodec(RenderOptions(apply_chat_template=True))


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
    assert isinstance(codec, HFTokenizerCodec) and not codec.has_chat_template
    assert codec.encode_prompt("hello world") == [2, 3]
    assert codec.decode([2, 1, 3]) == "hello world"
    assert codec.eos_ids == [1, 3]
    with pytest.raises(ValueError, match="data.apply_chat_template: true, but the tokenizer .* has no chat template"):
        load_codec(tmp_path, RenderOptions(apply_chat_template=True))
    with pytest.raises(ValueError, match="data.system_prompt: .* no chat template"):
        load_codec(tmp_path, RenderOptions(system_prompt="Be brief."))


def test_missing_tokenizer_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_codec(tmp_path)


def test_a_chat_prompt_is_the_whole_conversation_through_the_models_template(own_model):
    """The ids are transformers' ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` of every turn; the system turn is in them (it used to be dropped)."""
    codec = load_codec(own_model.model_dir)
    assert isinstance(codec, HFTokenizerCodec) and codec.use_template
    ids = codec.encode_prompt(Prompt(0, "", "5", messages=CHAT))
    hf = own_model.tokenizer()
    assert ids == hf.apply_chat_template(list(CHAT), add_generation_prompt=True, tokenize=True, return_dict=False)
    assert hf.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert codec.render_text(Prompt(0, "", "5", messages=CHAT)) == hf.decode(ids)
    earlier = (*CHAT, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 3?"})
    text = hf.decode(codec.encode_prompt(list(earlier)))
    assert "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n" in text


def test_plain_prompts_get_the_system_prompt_and_template_variables(own_model):
    codec = load_codec(own_model.model_dir, RenderOptions(system_prompt="Be brief.",
                                                          chat_template_kwargs={"enable_thinking": False}))
    text = own_model.tokenizer().decode(codec.encode_prompt("What is 2 + 3?"))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_off_sends_the_text_and_never_drops_turns(own_model):
    codec = load_codec(own_model.model_dir, RenderOptions(apply_chat_template=False))
    hf = own_model.tokenizer()
    ids = codec.encode_prompt(Prompt(0, "", "4", messages=({"role": "user", "content": "What is 2 + 2?"},)))
    assert hf.decode(ids) == "What is 2 + 2?"
    with pytest.raises(ValueError, match="chat of 2 messages"):
        codec.encode_prompt(Prompt(0, "", "5", messages=CHAT))


def test_stop_ids_come_from_generation_config_and_responses_skip_special_tokens(own_model):
    codec = load_codec(own_model.model_dir)
    hf = own_model.tokenizer()
    end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert codec.eos_ids == [end, eot]  # generation_config.json's list, in its order
    response = hf.encode("The answer is \\boxed{5}.", add_special_tokens=False) + [end]
    assert codec.decode(response) == "The answer is \\boxed{5}."
    assert codec.pad_id == eot
