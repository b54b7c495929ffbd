"""Functions a config names by ``module:function`` or ``path/to/file.py:function``.

WHY one loader: a user's reward (``data.reward_fn``) and rollout workflow (``rollout.workflow``) are
named the same way, and the errors a user sees (no such file, the import failed, no such function,
with the functions the module does have) must not differ between them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


def load_named_function(spec: str, key: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``spec`` names; ``key`` (the config key, e.g. ``data.reward_fn``) starts every
    message of the ``error`` raised when it cannot be loaded."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise error(f"{key}: {spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise error(f"{key}: no such file {target}")
        module_name = f"dora_plugin_{abs(hash(str(path)))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module  # dataclasses and pickling inside the file look their module up
        try:
            loader.loader.exec_module(module)
        except Exception as err:
            raise error(f"{key}: importing {target} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(target)
        except Exception as err:
            raise error(f"{key}: cannot import module {target!r}: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{key}: {target} has no function {name!r} (it has: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise error(f"{key}: {target}:{name} is a {type(fn).__name__}, not a function")
    return fn
