"""Defines torchvision's `nms`/`qnms` operator schemas before `torchvision` loads (SGLang CPU venv only).

Stands in for what torchvision's compiled extension (`torchvision/_C.so`) registers: PyPI's
torchvision 0.28.0 is a CUDA build whose extension does not load beside the CPU torch 2.13.0, and
then `import torchvision` fails in `torchvision/_meta_registrations.py` ("operator torchvision::nms
does not exist"). SGLang imports torchvision (through transformers' image processors) but never
calls these operators on the text-only path; the schemas only let the import finish, and a call
would fail with "no kernel registered". Installed by tools/setup_sglang_cpu.sh with
dora_tv_ops.pth, which calls `install()` at interpreter start; torch itself is only imported when
something imports torchvision, so other programs in the venv start as fast as before.
"""

import importlib.abc
import sys

_LIBRARY = []  # keeps the torch.library.Library alive: dropping it would remove the schemas


def _define_schemas():
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        if not _has_schema(name):
            lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(lib)


def _has_schema(name):
    import torch

    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Defines the schemas the first time `torchvision` is looked up, then lets the normal finders load it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_schemas()
        return None


def install():
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
