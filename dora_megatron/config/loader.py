"""Strict YAML -> typed dataclass loading, ``--set`` overrides and validation.

Why strict: an RL run that silently ignores ``max_stalenes: 3`` trains with the
default and wastes a cluster-day. Every unknown key is an error naming the key
and the closest valid spelling; every type or range problem names the full dotted
path of the field. The loader is generic over dataclasses, so sections only
declare fields (see :mod:`dora_megatron.config.base`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, TypeVar

from dora_megatron.config.base import ConfigError

T = TypeVar("T")

log = logging.getLogger(__name__)


class BoolWord(str):
    """A word YAML 1.1 reads as a boolean (``on``, ``off``, ``yes``, ``no``, any case), kept as
    written until the field it lands in says what it is: the word itself in a string field, its
    boolean in a boolean or free-form field (:func:`_coerce`)."""

    def __new__(cls, word: str, truth: bool) -> "BoolWord":
        obj = super().__new__(cls, word)
        obj.truth = truth
        return obj


def yaml_load(text: str) -> Any:
    """``text`` parsed as YAML, with YAML 1.1's boolean words left for the field to read.

    WHY: PyYAML follows YAML 1.1, where ``on``, ``off``, ``yes`` and ``no`` are booleans, so
    ``rollout.speculative: off`` (a choice among strings) arrived as ``False`` and was refused.
    YAML 1.2 makes them strings, which would silently turn ``enable_thinking: no`` in a free-form
    section (``data.chat_template_kwargs``, ``trainer.megatron``) into a true-ish string.
    So such a word is a :class:`BoolWord`: a string where the field is a string, a boolean where it
    is a boolean or untyped. ``true`` and ``false`` are booleans everywhere."""
    import yaml

    return yaml.load(text, Loader=_loader())


@functools.cache
def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader whose YAML 1.1 boolean words other than true/false load as :class:`BoolWord`."""

        def construct_yaml_bool(self, node):  # noqa: D102 - the tag's constructor, see the class
            word = self.construct_scalar(node)
            truth = self.bool_values[word.lower()]
            return truth if word.lower() in ("true", "false") else BoolWord(word, truth)

    Loader.add_constructor("tag:yaml.org,2002:bool", Loader.construct_yaml_bool)
    return Loader


def _plain(value: Any) -> Any:
    """``value`` with every :class:`BoolWord` in it (nested too) read as its boolean: an untyped field."""
    if isinstance(value, BoolWord):
        return value.truth
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _closest(key: str, valid: Iterable[str]) -> str:
    matches = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type or raise naming ``path``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _plain(value)
    if isinstance(value, BoolWord):  # the boolean where the field takes one (``str | bool`` too), else the word
        takes_bool = tp is bool or (origin in (typing.Union, types.UnionType) and bool in args)
        value = value.truth if takes_bool else str(value)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError(path, f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping for section {_type_name(tp)}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string; accept numeric text
            try:
                return float(value)
            except ValueError:
                raise ConfigError(path, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(path, f"expected a path string, got {value!r}")
        return Path(value)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"unsupported value {value!r} for type {_type_name(tp)}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    # a section's REMOVED_KEYS: {key: (the value it had by default, what to do instead)}
    removed: Mapping[str, tuple[Any, str]] = getattr(cls, "REMOVED_KEYS", {})
    data = dict(data)
    for key in list(data):
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            if key in removed:
                old_default, instead = removed[key]
                if data[key] == old_default:
                    # the resolved config.yaml of a run made before the removal lists every key with
                    # its default (which did nothing): --resume of that run must still load
                    log.warning("%s: ignored (the key was removed; %s)", where, instead)
                    del data[key]
                    continue
                raise ConfigError(where, f"this key was removed: {instead}")
            raise ConfigError(where, f"unknown key{_closest(str(key), fields)}; valid keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(path or cls.__name__, str(err)) from err


def _check_ranges(obj: Any, path: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{path}.{f.name}" if path else f.name
        meta = f.metadata or {}
        if value is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if meta.get("ge") is not None and value < meta["ge"]:
                raise ConfigError(where, f"must be >= {meta['ge']}, got {value}")
            if meta.get("gt") is not None and value <= meta["gt"]:
                raise ConfigError(where, f"must be > {meta['gt']}, got {value}")
            if meta.get("le") is not None and value > meta["le"]:
                raise ConfigError(where, f"must be <= {meta['le']}, got {value}")
            if meta.get("lt") is not None and value >= meta["lt"]:
                raise ConfigError(where, f"must be < {meta['lt']}, got {value}")
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(where, f"must be one of {list(choices)}, got {value!r}")
        if dataclasses.is_dataclass(value):
            validate(value, where)


def validate(obj: Any, path: str = "") -> None:
    """Check declarative ranges recursively, then each section's ``check``."""
    _check_ranges(obj, path)
    check = getattr(obj, "check", None)
    if callable(check):
        check(path)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (``3``, ``true``, ``[1,2]``)."""
    import yaml

    if "=" not in item:
        raise ConfigError(item, "override must look like section.key=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(item, "override has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse override value {raw!r}: {err}") from err
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to a raw config mapping (before typing)."""
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(keys), f"'{k}' is not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "config file not found")
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"invalid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(str(path), "top level of a config must be a mapping")
    return data


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (for YAML dumps of the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def dump_yaml(obj: Any) -> str:
    import yaml

    return yaml.safe_dump(to_dict(obj), sort_keys=False)
