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
