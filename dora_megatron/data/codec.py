"""Prompts -> token ids and response ids -> text, for the controller: the one place prompts are rendered.

Why a seam here: engines speak token ids only (SGLang with ``--skip-tokenizer-init``), so the
controller renders prompts and detokenizes responses for the reward. Every path that encodes a
prompt (the controller's dispatch, the capacity pass, held-out evaluation, the tools) calls
:meth:`TextCodec.encode_prompt`, so what a model is sent cannot differ between them (DESIGN
section 13).

* The tiny preset models use the fixed character vocabulary of :mod:`dora_megatron.data.tokenizer`
  (:class:`CharCodec`): a prompt is its text after a BOS, as the digit tasks were trained.
* A model directory with its own tokenizer (:class:`HFTokenizerCodec`) is rendered by transformers
  itself: with a chat template, the ids are exactly ``tokenizer.apply_chat_template(messages,
  add_generation_prompt=True, tokenize=True, **data.chat_template_kwargs)`` of the whole message list
  (system, user, earlier turns); without one, the plain text through the tokenizer with its special
  tokens. No template is written here: the model directory's template is the only one.

Stop ids: ``generation_config.json``'s ``eos_token_id`` (one or a list), ``config.json``'s and the
tokenizer's EOS, in that order. Responses are decoded with special tokens skipped (what a reward
function is given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, Union

from dora_megatron.data import tokenizer as tok

#: What a prompt is before rendering: a plain string, or a chat message list ``[{role, content}, ...]``.
PromptContent = Union[str, Sequence[Mapping[str, Any]]]


class TextCodec(Protocol):
    eos_ids: list[int]

    def encode_prompt(self, prompt: Any) -> list[int]:
        """Token ids of ``prompt`` (a :class:`~dora_megatron.data.tasks.Prompt`, a string or a message list)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_rendered(self, ids: Sequence[int]) -> str:
        """Prompt ids as the model sees them: decoded with the special tokens kept (rollout dumps)."""
        ...


@dataclass(frozen=True)
class RenderOptions:
    """``data.apply_chat_template``, ``data.system_prompt``, ``data.chat_template_kwargs``."""

    apply_chat_template: str | bool = "auto"
    system_prompt: str = ""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, data: Any) -> "RenderOptions":
        return cls(data.apply_chat_template, data.system_prompt, dict(data.chat_template_kwargs))


def prompt_content(prompt: Any) -> PromptContent:
    """The content of a :class:`~dora_megatron.data.tasks.Prompt` (its message list when it has one),
    or ``prompt`` itself when it is already a string or a message list."""
    messages = getattr(prompt, "messages", None)
    if messages:
        return list(messages)
    text = getattr(prompt, "text", prompt)
    return text


def check_messages(value: Any) -> str | None:
    """Why ``value`` is not a chat message list (non-empty, each a mapping with string ``role`` and
    ``content``), or None."""
    if not isinstance(value, (list, tuple)) or not value:
        return "an empty message list" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            return f"message {i} is a {type(m).__name__}, not a mapping with role and content"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if m.get(key) is None else f"a {type(m.get(key)).__name__}"
                return f"message {i}: '{key}' is {got}, not a string"
    return None


def _plain_text(content: PromptContent, why_no_template: str) -> str:
    """The text of a prompt rendered without a template: a string, or a list of one user message
    (nothing is lost then). Anything longer needs the template."""
    if isinstance(content, str):
        return content
    if len(content) == 1 and content[0].get("role") == "user":
        return str(content[0]["content"])
    roles = ", ".join(str(m.get("role")) for m in content)
    raise ValueError(f"the prompt is a chat of {len(content)} messages ({roles}) and {why_no_template}: "
                     "it cannot be sent without dropping turns (use a model whose tokenizer has a chat "
                     "template, or prompts of one user message)")


class CharCodec:
    """The project's character vocabulary (ids fixed in :mod:`dora_megatron.data.tokenizer`); it has no
    chat template: a prompt is its text after a BOS."""

    eos_ids = [tok.EOS_ID]
    pad_id = tok.PAD_ID
    has_chat_template = False

    def __init__(self, options: RenderOptions | None = None) -> None:
        options = options or RenderOptions()
        if options.apply_chat_template is True:
            raise ValueError("data.apply_chat_template: true, but the preset character vocabulary has no chat "
                             "template (use model.path with a tokenizer that has one, or set it to auto)")
        if options.system_prompt:
            raise ValueError("data.system_prompt: the preset character vocabulary has no chat template to put it in")

    def encode_prompt(self, prompt: Any) -> list[int]:
        text = _plain_text(prompt_content(prompt), "the preset character vocabulary has no chat template")
        return tok.encode(text, add_bos=True)

    def render_text(self, prompt: Any) -> str:
        return self.decode_rendered(self.encode_prompt(prompt))

    def decode_rendered(self, ids: Sequence[int]) -> str:
        return tok.decode(ids, skip_special=False)

    def decode(self, ids: Sequence[int]) -> str:
        return tok.decode(ids)


class HFTokenizerCodec:
    """A model directory's own tokenizer, loaded by transformers (``AutoTokenizer``; a directory with
    only ``tokenizer.json`` through ``PreTrainedTokenizerFast``), and its chat template."""

    def __init__(self, model_dir: str | Path, options: RenderOptions | None = None) -> None:
        model_dir = Path(model_dir)
        self.options = options or RenderOptions()
        self.tokenizer = load_hf_tokenizer(model_dir)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        want = self.options.apply_chat_template
        if want is True and not self.has_chat_template:
            raise ValueError(f"data.apply_chat_template: true, but the tokenizer of {model_dir} has no chat template "
                             "(no chat_template.jinja, and none in tokenizer_config.json)")
        self.use_template = self.has_chat_template and want is not False
        if self.options.system_prompt and not self.use_template:
            raise ValueError(f"data.system_prompt: the tokenizer of {model_dir} has no chat template to put it in")
        if self.options.chat_template_kwargs and not self.use_template:
            raise ValueError(f"data.chat_template_kwargs: the tokenizer of {model_dir} has no chat template to pass them to")
        config = _read_json(model_dir / "config.json")
        gen = _read_json(model_dir / "generation_config.json")
        eos: list[Any] = []
        for value in (gen.get("eos_token_id"), config.get("eos_token_id"), self.tokenizer.eos_token_id):
            eos += value if isinstance(value, list) else [value]
        self.eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        self.bos_id = config.get("bos_token_id")
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))

    def messages(self, content: PromptContent) -> list[dict[str, Any]]:
        """The message list a prompt is rendered from: its own, or a plain string as the user turn after
        ``data.system_prompt``."""
        if isinstance(content, str):
            system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
            return [*system, {"role": "user", "content": content}]
        return [dict(m) for m in content]

    def encode_prompt(self, prompt: Any) -> list[int]:
        return self.encode_prompts([prompt])[0]

    def encode_prompts(self, prompts: Sequence[Any]) -> list[list[int]]:
        """:meth:`encode_prompt` of many at once (one batched tokenizer call: checking a dataset at load)."""
        contents = [prompt_content(p) for p in prompts]
        if self.use_template:
            out = self.tokenizer.apply_chat_template([self.messages(c) for c in contents], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False,
                                                     **dict(self.options.chat_template_kwargs))
            return [list(map(int, ids)) for ids in out]
        texts = [_plain_text(c, "the tokenizer's chat template is not applied") for c in contents]
        return [list(map(int, ids)) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def render_text(self, prompt: Any) -> str:
        """The prompt as the model sees it (its ids decoded with the special tokens kept)."""
        return self.decode_rendered(self.encode_prompt(prompt))

    def decode_rendered(self, ids: Sequence[int]) -> str:
        """``ids`` decoded with the special tokens kept (the chat template's markers stay visible)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """transformers' tokenizer of ``model_dir``: ``AutoTokenizer`` when the directory says which one
    (``tokenizer_config.json``), else ``PreTrainedTokenizerFast`` around its ``tokenizer.json``."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / tok.TOKENIZER_FILE))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def is_char_vocab(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s ``tokenizer.json`` is the project's character vocabulary (``dora init-model``)."""
    path = Path(model_dir) / tok.TOKENIZER_FILE
    vocab = json.loads(path.read_text()).get("model", {}).get("vocab", {}) if path.is_file() else None
    return isinstance(vocab, dict) and vocab == tok.vocab()


def load_codec(model_dir: str | Path, options: RenderOptions | None = None) -> TextCodec:
    """The char codec for directories made by ``dora init-model``, else the directory's tokenizer.
    Raises ValueError naming the ``data.*`` key when ``options`` ask for what the tokenizer lacks."""
    model_dir = Path(model_dir)
    path = model_dir / tok.TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model.path: no {tok.TOKENIZER_FILE} in {model_dir} (engines take token ids; "
                                "the controller needs the tokenizer)")
    if is_char_vocab(model_dir):
        return CharCodec(options)
    return HFTokenizerCodec(model_dir, options)
