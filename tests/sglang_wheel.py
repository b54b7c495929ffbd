"""SGLang 0.5.23's own request schemas, loaded from its wheel on CPU, to validate what dora sends.

WHY: a stand-in written from reading SGLang can only agree with the reader. The wheel's request
types are the judge instead: ``sglang/api/v1/api_types.py`` (the ``/generate`` and
``/abort_request`` JSON contract, which ``http_server.py`` applies to every ``/generate`` body) and
the ``*ReqInput`` structs of ``sglang/srt/managers/io_struct.py`` that FastAPI validates the
weight-update bodies with (through ``msgspec_struct_pydantic_core_schema`` of
``sglang/srt/utils/msgspec_utils.py``, here too).

Importing ``sglang`` itself is neither possible nor wanted on CPU: its ``__init__`` pulls CUDA
torchvision and patches transformers. ``api_types.py`` and ``msgspec_utils.py`` need only msgspec
and pydantic-core, so they are loaded by file path; ``io_struct.py`` imports half of SGLang, so the
request classes named in :data:`ROUTES` are cut out of its source (``ast``) and executed alone, with
typing names and the markers they use. Nothing is copied into this repository: the code runs from
the wheel that ``tools/setup_env.sh`` unpacks (``pip install --no-deps --target <venv>/sglang-wheel``,
deliberately *not* importable as ``sglang``, so no check mistakes it for a usable SGLang).

The server's command-line flags are read the same way, from source text only
(:func:`server_flags`: the ``A[type, "help" | Arg(...)]`` fields of
``sglang/srt/arg_groups/fields/*.py``, which ``arg_utils.add_cli_args_from_dataclass`` turns into
``--field-name`` flags), so ``dora_flags`` can be checked against 0.5.23's argument definitions.

Where the wheel is: ``$DORA_SGLANG_SRC`` (a directory holding ``sglang/``), else
``<sys.prefix>/sglang-wheel``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WHEEL_VERSION = "0.5.23"

#: route -> (where the type lives, its name)
ROUTES: dict[str, tuple[str, str]] = {
    "/generate": ("api", "GenerateRequest"),
    "/abort_request": ("api", "AbortRequest"),
    "/pause_generation": ("io", "PauseGenerationReqInput"),
    "/continue_generation": ("io", "ContinueGenerationReqInput"),
    "/update_weights_from_disk": ("io", "UpdateWeightFromDiskReqInput"),
    "/update_weights_from_distributed": ("io", "UpdateWeightsFromDistributedReqInput"),
    "/init_weights_update_group": ("io", "InitWeightsUpdateGroupReqInput"),
    "/destroy_weights_update_group": ("io", "DestroyWeightsUpdateGroupReqInput"),
    "/begin_weight_update": ("io", "BeginWeightUpdateReqInput"),
    "/end_weight_update": ("io", "EndWeightUpdateReqInput"),
    "/weights_checker": ("io", "CheckWeightsReqInput"),
}


class SchemaError(ValueError):
    """A body SGLang 0.5.23 refuses (``message`` is SGLang's or pydantic's own text)."""


def wheel_root() -> Path | None:
    """The directory holding the wheel's ``sglang/`` package, or None."""
    for cand in (os.environ.get("DORA_SGLANG_SRC"), str(Path(sys.prefix) / "sglang-wheel")):
        if cand and (Path(cand) / "sglang" / "srt" / "managers" / "io_struct.py").is_file():
            return Path(cand)
    return None


def wheel_version(root: Path) -> str | None:
    """``__version__`` as the wheel's ``sglang/_version.py`` writes it (read, not imported)."""
    path = root / "sglang" / "_version.py"
    for line in path.read_text().splitlines() if path.is_file() else ():
        if line.startswith("__version__ ="):
            return line.split("=")[-1].strip().strip("\"'")
    return None


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # msgspec resolves postponed annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _io_structs(root: Path, msgspec_utils: types.ModuleType) -> types.ModuleType:
    """The ``BaseReq`` family of ``io_struct.py`` named in :data:`ROUTES`, executed on their own."""
    import msgspec

    source = (root / "sglang" / "srt" / "managers" / "io_struct.py").read_text()
    tree = ast.parse(source)
    wanted = {"BaseReq"} | {n for kind, n in ROUTES.values() if kind == "io"}
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in wanted]
    missing = wanted - {c.name for c in classes}
    if missing:
        raise RuntimeError(f"io_struct.py of this wheel lacks {sorted(missing)}")
    name = "_dora_sglang_wheel_io_struct"
    mod = types.ModuleType(name)
    mod.__dict__.update({k: getattr(typing, k) for k in ("Any", "Dict", "List", "Literal", "Optional", "Union",
                                                         "Annotated", "Tuple")})
    mod.__dict__.update(msgspec=msgspec, msgspec_struct_pydantic_core_schema=msgspec_utils.msgspec_struct_pydantic_core_schema,
                        Base64Bytes=msgspec_utils.Base64Bytes)
    sys.modules[name] = mod
    body = "from __future__ import annotations\n" + "\n\n".join(ast.get_source_segment(source, c) or "" for c in classes)
    exec(compile(body, str(root / "sglang/srt/managers/io_struct.py"), "exec"), mod.__dict__)  # noqa: S102 - the wheel's own classes
    return mod


@dataclass
class WheelSchemas:
    """Validates request bodies the way SGLang 0.5.23's HTTP server does."""

    root: Path

    def __post_init__(self) -> None:
        import pydantic

        self.version = wheel_version(self.root)
        base = self.root / "sglang"
        self._utils = _load_file("_dora_sglang_wheel_msgspec_utils", base / "srt" / "utils" / "msgspec_utils.py")
        self._api = _load_file("_dora_sglang_wheel_api_types", base / "api" / "v1" / "api_types.py")
        self._io = _io_structs(self.root, self._utils)
        self._adapters: dict[str, Any] = {}
        for route, (kind, name) in ROUTES.items():
            if kind == "io":
                self._adapters[route] = pydantic.TypeAdapter(getattr(self._io, name))

    def type_of(self, route: str) -> type:
        kind, name = ROUTES[route]
        return getattr(self._api if kind == "api" else self._io, name)

    def validate(self, route: str, body: Any) -> Any:
        """The parsed request, or :class:`SchemaError` with SGLang's reason."""
        import pydantic

        kind, _ = ROUTES[route]
        try:
            if kind == "api":
                return self.type_of(route).from_json_value(body)
            return self._adapters[route].validate_python(body)
        except (self._api.JsonContractError, pydantic.ValidationError, TypeError, ValueError) as exc:
            raise SchemaError(f"{route}: {exc}") from None

    def ignored_fields(self, route: str, body: dict[str, Any]) -> list[str]:
        """Keys of ``body`` SGLang would drop without a word (it ignores unknown keys there)."""
        import msgspec

        known = {f.name for f in msgspec.structs.fields(self.type_of(route))}
        return sorted(set(body) - known)


@functools.lru_cache(maxsize=1)
def load() -> WheelSchemas | None:
    """The wheel's schemas (loaded once per process), or None when the wheel or msgspec is missing."""
    root = wheel_root()
    if root is None or importlib.util.find_spec("msgspec") is None:
        return None
    return WheelSchemas(root)


@dataclass(frozen=True)
class WheelFlag:
    """One ``launch_server`` flag as 0.5.23 defines it: its field, its choices (None: any value),
    whether it is a switch that takes no value."""

    field: str
    choices: tuple[Any, ...] | None
    switch: bool


def _module_constants(path: Path) -> dict[str, Any]:
    """Top-level ``NAME = <literal>`` assignments of a source file (the ``*_CHOICES`` lists)."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _literal_values(node: ast.AST) -> tuple[Any, ...] | None:
    """The values of ``Literal[...]`` (also inside ``Optional[...]``), else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return tuple(ast.literal_eval(e) for e in elts)
        if node.value.id == "Optional":
            return _literal_values(node.slice)
    return None


def _choices(node: ast.AST, constants: dict[str, Any]) -> tuple[Any, ...] | None:
    """``choices=`` as written: a literal list, a ``choices.py`` constant, or their sums; None
    (any value accepted by this check) for anything computed otherwise."""
    if isinstance(node, ast.Name):
        return tuple(constants[node.id]) if node.id in constants else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _choices(node.left, constants), _choices(node.right, constants)
        return None if left is None or right is None else left + right
    try:
        return tuple(ast.literal_eval(node))
    except ValueError:
        return None


def server_flags(root: Path) -> dict[str, WheelFlag]:
    """Every CLI flag (and alias) of the ``arg_groups/fields`` records, with its choices."""
    base = root / "sglang" / "srt" / "arg_groups"
    constants = _module_constants(base / "choices.py")
    flags: dict[str, WheelFlag] = {}
    for path in sorted((base / "fields").glob("*.py")):
        for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                ann = node.annotation if isinstance(node, ast.AnnAssign) else None
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"
                        and isinstance(ann.slice, ast.Tuple)):
                    continue
                inner, meta = ann.slice.elts[0], ann.slice.elts[1]
                kw = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    continue
                choices = _literal_values(inner)
                if "choices" in kw:
                    choices = _choices(kw["choices"], constants)
                switch = isinstance(inner, ast.Name) and inner.id == "bool" and "action" not in kw
                name = node.target.id
                cli = ast.literal_eval(kw["cli_name"]) if "cli_name" in kw else "--" + name.replace("_", "-")
                aliases = ast.literal_eval(kw["aliases"]) if "aliases" in kw else []
                for flag in (cli, *aliases):
                    flags[flag] = WheelFlag(name, choices, switch)
    return flags


def speculative_algorithms(root: Path) -> frozenset[str]:
    """What ``SpeculativeAlgorithm.from_string`` accepts without plugins: the members of the enum
    (``srt/speculative/spec_info.py``) and the reserved aliases (``spec_registry.py``)."""
    spec = root / "sglang" / "srt" / "speculative"
    names: set[str] = set()
    for node in ast.parse((spec / "spec_info.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeAlgorithm":
            names |= {t.id for a in node.body if isinstance(a, ast.Assign) for t in a.targets if isinstance(t, ast.Name)}
    aliases = _module_constants(spec / "spec_registry.py").get("_RESERVED_ALIASES")
    if aliases is None:  # frozenset({...}) is a call, not a literal
        for node in ast.parse((spec / "spec_registry.py").read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == "_RESERVED_ALIASES" and isinstance(node.value, ast.Call)):
                aliases = ast.literal_eval(node.value.args[0])
    return frozenset(names - {"NONE"}) | frozenset(aliases or ())


@dataclass(frozen=True)
class WheelAuth:
    """0.5.23's HTTP auth: its pure decision function (``sglang/srt/utils/auth.py``, loaded by file
    path: it imports nothing of SGLang) and the auth level of each route of ``http_server.py``
    (read from the ``@auth_level(AuthLevel.X)`` decorators; routes without one are NORMAL)."""

    module: types.ModuleType
    levels: dict[str, str]  # route path -> AuthLevel member name

    def decide(self, method: str, path: str, authorization: str | None, api_key: str | None,
               admin_api_key: str | None) -> int | None:
        """None when 0.5.23 serves the request, else its status (401 or 403)."""
        level = self.module.AuthLevel[self.levels.get(path, "NORMAL")]
        d = self.module.decide_request_auth(method=method, path=path, authorization_header=authorization,
                                            api_key=api_key, admin_api_key=admin_api_key, auth_level=level)
        return None if d.allowed else d.error_status_code


def route_auth_levels(root: Path) -> dict[str, str]:
    """Route path -> auth level name for the literal routes of 0.5.23's ``http_server.py``."""
    levels: dict[str, str] = {}
    tree = ast.parse((root / "sglang" / "srt" / "entrypoints" / "http_server.py").read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, level = [], "NORMAL"
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            name = dec.func.attr if isinstance(dec.func, ast.Attribute) else getattr(dec.func, "id", "")
            if name in ("get", "post", "put", "delete", "api_route") and dec.args \
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str):
                paths.append(dec.args[0].value)
            if name == "auth_level" and dec.args and isinstance(dec.args[0], ast.Attribute):
                level = dec.args[0].attr
        for p in paths:
            levels[p] = level
    return levels


@functools.lru_cache(maxsize=1)
def load_auth() -> WheelAuth | None:
    """0.5.23's auth (once per process), or None without the wheel."""
    root = wheel_root()
    if root is None:
        return None
    return WheelAuth(_load_file("sglang_wheel_auth", root / "sglang" / "srt" / "utils" / "auth.py"),
                     route_auth_levels(root))
