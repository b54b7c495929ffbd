"""The generic loader: strict keys, types, ranges, section checks, overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from dora_megatron.config.base import ConfigError, field_doc
from dora_megatron.config.loader import apply_overrides, dump_yaml, from_dict, parse_override, validate


@dataclass
class Inner:
    size: int = field_doc(4, "a size", ge=1)
    ratio: float = field_doc(0.5, "a ratio", ge=0.0, le=1.0)
    kind: str = field_doc("a", "a kind", choices=("a", "b"))
    names: list[str] = field_doc(default_factory=list, doc="names")


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    flag: bool = field_doc(False, "a flag")
    maybe: Optional[int] = field_doc(None, "optional int")
    mode: Literal["x", "y"] = field_doc("x", "literal")
    low: int = field_doc(1, "low")
    high: int = field_doc(2, "high")

    def check(self, path: str) -> None:
        if self.high < self.low:
            raise ConfigError("high", f"must be >= low ({self.low})")


def load(data):
    cfg = from_dict(Outer, data)
    validate(cfg)
    return cfg


def test_valid_nested_and_defaults():
    cfg = load({"inner": {"size": 8, "ratio": 1, "names": ["p", "q"]}, "flag": True, "maybe": 3})
    assert cfg.inner.size == 8 and cfg.inner.ratio == 1.0 and isinstance(cfg.inner.ratio, float)
    assert cfg.inner.names == ["p", "q"] and cfg.flag is True and cfg.maybe == 3
    assert cfg.inner.kind == "a" and cfg.mode == "x"


def test_unknown_key_names_key_and_suggestion():
    with pytest.raises(ConfigError) as err:
        load({"inner": {"sise": 3}})
    msg = str(err.value)
    assert "inner.sise" in msg and "did you mean 'size'" in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"flg.*did you mean 'flag'"):
        load({"flg": True})


@pytest.mark.parametrize(
    "data,where",
    [
        ({"inner": {"size": "4"}}, "inner.size"),
        ({"inner": {"size": True}}, "inner.size"),
        ({"inner": {"ratio": "high"}}, "inner.ratio"),
        ({"flag": "yes"}, "flag"),
        ({"maybe": 1.5}, "maybe"),
        ({"inner": {"names": "p"}}, "inner.names"),
        ({"inner": {"names": [1]}}, "inner.names[0]"),
        ({"mode": "z"}, "mode"),
        ({"inner": 3}, "inner"),
    ],
)
def test_wrong_types_name_the_field(data, where):
    with pytest.raises(ConfigError) as err:
        load(data)
    assert err.value.path == where


@pytest.mark.parametrize(
    "data,where",
    [({"inner": {"size": 0}}, "inner.size"), ({"inner": {"ratio": 1.5}}, "inner.ratio"), ({"inner": {"kind": "c"}}, "inner.kind")],
)
def test_ranges_and_choices(data, where):
    with pytest.raises(ConfigError) as err:
        load(data)
    assert err.value.path == where


def test_cross_field_check():
    with pytest.raises(ConfigError, match="high.*must be >= low"):
        load({"low": 5, "high": 2})


def test_scientific_notation_without_dot_is_a_number():
    cfg = load(apply_overrides({}, ["inner.ratio=5e-1"]))
    assert cfg.inner.ratio == 0.5


def test_overrides_parse_yaml_values():
    data = apply_overrides({"inner": {"size": 2}}, ["inner.size=16", "flag=true", "inner.names=[a, b]", "maybe=7"])
    cfg = load(data)
    assert cfg.inner.size == 16 and cfg.flag is True and cfg.inner.names == ["a", "b"] and cfg.maybe == 7


def test_yaml_1_1_boolean_words_read_as_the_field_says(tmp_path):
    """``off``/``on``/``yes``/``no`` are booleans to YAML 1.1 (PyYAML): ``rollout.speculative=off``
    arrived as False and was refused. Now such a word is the word in a string field, its boolean in
    a boolean field, in a ``str | bool`` field and in a free-form section (where a string ``no``
    would turn a template's ``enable_thinking`` on); ``true``/``false`` stay booleans everywhere, and
    the resolved config written to the run reads back the same."""
    from dora_megatron.config.loader import dump_yaml, read_yaml
    from dora_megatron.config.schema import DoraConfig, load_config

    cfg = load_config(None, ["rollout.speculative=off"])
    assert cfg.rollout.speculative == "off" and type(cfg.rollout.speculative) is str
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  speculative: off\ndata:\n"
                    "  chat_template_kwargs: {enable_thinking: no, style: [on, plain]}\n")
    cfg = load_config(path, [])
    assert cfg.rollout.speculative == "off"
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "style": [True, "plain"]}
    assert load_config(None, ["data.apply_chat_template=no"]).data.apply_chat_template is False
    assert load(apply_overrides({}, ["flag=yes"])).flag is True
    assert load(apply_overrides({"flag": True}, ["flag=Off"])).flag is False
    assert load(apply_overrides({}, ["flag=True"])).flag is True
    with pytest.raises(ConfigError, match="inner.kind"):  # a string field takes the word, then its choices
        load(apply_overrides({}, ["inner.kind=no"]))
    (tmp_path / "resolved.yaml").write_text(dump_yaml(cfg))
    assert from_dict(DoraConfig, read_yaml(tmp_path / "resolved.yaml")) == cfg


def test_override_errors():
    with pytest.raises(ConfigError):
        parse_override("noequals")
    with pytest.raises(ConfigError):
        apply_overrides({"flag": 1}, ["flag.sub=2"])
    with pytest.raises(ConfigError, match="inner.bogus"):
        load(apply_overrides({}, ["inner.bogus=1"]))


def test_dump_roundtrip():
    import yaml

    cfg = load({"inner": {"size": 5}})
    again = load(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg
