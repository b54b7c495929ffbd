"""Run Megatron-Core on CPU (gloo): the one place that patches Megatron.

WHY: megatron-core has no CPU path ("There is no CPU-only path in Megatron Core"): its schedules,
DDP buffers, optimizers, RNG tracker and checkpoint writer allocate on ``"cuda"`` /
``torch.cuda.current_device()`` and assert ``torch.cuda.FloatTensor`` types. For CI and the
laptop-class default we still want to exercise the *real* Megatron code paths (schedules, DDP,
distributed optimizer, TP/PP/EP over gloo, ``dist_checkpointing``). This module makes that possible
with a small, reversible set of redirections (DESIGN section 7):

* a :class:`torch.overrides.TorchFunctionMode` that rewrites CUDA ``device`` arguments to CPU,
  makes ``Tensor.cuda()``/``pin_memory()`` no-ops and makes ``Tensor.type()`` report the
  ``torch.cuda.*`` names Megatron asserts on;
* ``torch.cuda`` helpers (``current_device``, ``synchronize``, ``empty_cache``, streams, events,
  RNG state) redirected to CPU equivalents;
* Megatron's RNG tracker helpers ``_get_cuda_rng_state``/``_set_cuda_rng_state`` redirected to the
  CPU generator;
* ``te_general_gemm = None`` in ``megatron.core.transformer.moe.moe_utils`` (it is referenced but
  undefined when Transformer Engine is absent);
* the alltoall MoE dispatcher's ``maybe_move_tensor_to_cpu`` (its name in
  ``megatron.core.transformer.moe.token_dispatcher``) also turns a CPU tensor into the numpy array
  it asks for: on CUDA the split sizes of ``all_to_all`` arrive as numpy arrays from the device-to-host
  copy, on CPU there is no copy and torch's ``all_to_all_single`` refuses a tensor of sizes;
* ``HAVE_TE = False`` in ``megatron.core.transformer.multi_latent_attention`` when Transformer
  Engine is absent (the TE extension module imports without TE, its classes built on a MagicMock,
  so MLA sets the flag and then calls ``isinstance(linear_proj, <a MagicMock>)``).

It is active only while a handle returned by :func:`activate` is open (or inside
:func:`cpu_compat`), only for device ``cpu``, and :meth:`CompatHandle.deactivate` restores every
patched attribute. Nothing else in the project patches Megatron. The other CPU requirement (a
sequence-parallel-capable norm) is a model-build choice made in :mod:`dora_megatron.trainer.model`,
not a patch.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")

# Tensor.type() names Megatron compares against, CPU name -> CUDA name.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare int device index means a CUDA ordinal in torch's API.
    return isinstance(dev, int) and not isinstance(dev, bool)


def _map_device(dev: Any) -> Any:
    return _CPU if _is_cuda_device(dev) else dev


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while active."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.is_pinned:
            return False
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _map_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: all work is synchronous on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event or _NullEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NullEvent:
    """Stand-in for ``torch.cuda.Event`` (timing returns 0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


@contextlib.contextmanager
def _null_stream_ctx(stream: Any = None) -> Iterator[None]:
    yield


def _cpu_maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on CPU (see the module docstring)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@dataclass
class CompatHandle:
    """An active compatibility layer; :meth:`deactivate` undoes everything (idempotent)."""

    _mode: TorchFunctionMode | None
    _saved: list[tuple[Any, str, Any, bool]] = field(default_factory=list)
    active: bool = True

    def deactivate(self) -> None:
        if not self.active:
            return
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        for obj, name, old, existed in reversed(self._saved):
            if existed:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._saved.clear()
        self.active = False
        logger.debug("Megatron CPU compatibility layer deactivated")

    def __enter__(self) -> "CompatHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()


def _patch(saved: list, obj: Any, name: str, value: Any) -> None:
    existed = hasattr(obj, name)
    saved.append((obj, name, getattr(obj, name, None), existed))
    setattr(obj, name, value)


def activate(device: str = "cpu") -> CompatHandle:
    """Activate the layer for ``device``; for anything but ``"cpu"`` this is a no-op handle.

    Must be called in the thread that runs Megatron (torch function modes are thread-local).
    Megatron modules are imported here so that their attributes can be redirected.
    """
    if device != "cpu":
        return CompatHandle(_mode=None, active=False)
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.transformer.multi_latent_attention as mla

    saved: list = []
    cuda = torch.cuda
    _patch(saved, cuda, "current_device", lambda: "cpu")
    _patch(saved, cuda, "synchronize", lambda *a, **k: None)
    _patch(saved, cuda, "empty_cache", lambda *a, **k: None)
    _patch(saved, cuda, "Stream", _NullStream)
    _patch(saved, cuda, "Event", _NullEvent)
    _patch(saved, cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(saved, cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(saved, cuda, "stream", _null_stream_ctx)
    _patch(saved, cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(saved, cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    _patch(saved, cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed))
    _patch(saved, mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(saved, mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(saved, moe_utils, "te_general_gemm", None)
    _patch(saved, token_dispatcher, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu)
    if not te_ext.HAVE_TE:
        # MLA believes TE is there when the TE extension module imports (it does without TE, its
        # classes built on a MagicMock) and then calls isinstance(linear_proj, <a MagicMock>)
        _patch(saved, mla, "HAVE_TE", False)
    # the dispatcher caches its device-to-host stream on the class: it gets a null stream here, dropped again
    _patch(saved, token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None)
    mode = _CudaToCpuMode()
    mode.__enter__()
    logger.debug("Megatron CPU compatibility layer active")
    return CompatHandle(_mode=mode, _saved=saved)


@contextlib.contextmanager
def cpu_compat(device: str = "cpu") -> Iterator[CompatHandle]:
    """Context-manager form of :func:`activate`."""
    handle = activate(device)
    try:
        yield handle
    finally:
        handle.deactivate()
