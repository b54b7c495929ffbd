"""Deterministic bucket plans for streaming weights to rollout engines.

WHY: a weight sync sends thousands of tensors; one HTTP call + one broadcast per tensor costs a
round trip each, one call for the whole model needs the whole model in one buffer. Buckets of at
most ``bucket_mb`` megabytes bound the sender's and the receiver's extra memory while keeping the
number of round trips small. The plan must be a pure function of the tensor list (names, dtypes,
shapes, order) so that every sender rank, every receiver and every retry agree on it; a tensor
larger than the bucket gets a bucket of its own (tensors are never split: the receiving side loads
whole HF tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:
    import torch

MB = 1 << 20

_DTYPE_BYTES = {
    "float64": 8, "double": 8, "int64": 8, "long": 8, "complex64": 8,
    "float32": 4, "float": 4, "int32": 4, "int": 4, "uint32": 4,
    "float16": 2, "half": 2, "bfloat16": 2, "int16": 2, "short": 2, "uint16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a dtype given as ``torch.float32``, ``"torch.float32"`` or ``"float32"``."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class TensorSpec:
    """What the plan needs to know of one tensor (no data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors sent with one ``/update_weights_from_distributed`` call."""

    index: int
    specs: tuple[TensorSpec, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def dtypes(self) -> list[str]:
        return [s.dtype for s in self.specs]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(s.shape) for s in self.specs]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The :class:`TensorSpec` of a torch tensor (dtype without the ``torch.`` prefix)."""
    return TensorSpec(name, str(tensor.dtype).replace("torch.", ""), tuple(int(s) for s in tensor.shape))


def plan_buckets(specs: Iterable[TensorSpec | tuple[str, object, Sequence[int]]], bucket_mb: float,
                 together: Callable[[str], str | None] | None = None) -> list[Bucket]:
    """Split ``specs`` (in the given order) into consecutive buckets of at most ``bucket_mb`` MiB.

    Greedy and order-preserving: a tensor joins the current bucket if the bucket stays within the
    limit, else it starts a new one; a tensor bigger than the limit is alone in its bucket. Every
    tensor is in exactly one bucket; duplicate names are an error (the receiver keys by name).

    ``together`` (name -> key or None): consecutive tensors with one key are placed as one (never
    split over buckets), for an engine that loads them only from one call
    (:func:`dora_megatron.weights.naming.load_together`); a key whose tensors are not consecutive is
    an error, as it could not be kept whole."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    limit = int(bucket_mb * MB)
    units: list[list[TensorSpec]] = []
    seen: set[str] = set()
    closed: set[str] = set()  # keys whose run of consecutive tensors has ended
    key_of_last: str | None = None
    for item in specs:
        spec = item if isinstance(item, TensorSpec) else TensorSpec(
            str(item[0]), str(item[1]).replace("torch.", ""), tuple(int(s) for s in item[2]))
        if spec.name in seen:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)
        key = together(spec.name) if together is not None else None
        if key is not None and key in closed:
            raise ValueError(f"tensor {spec.name!r} loads together with others ({key}) but does not follow them")
        if key is not None and key == key_of_last:
            units[-1].append(spec)
        else:
            if key_of_last is not None:
                closed.add(key_of_last)
            units.append([spec])
        key_of_last = key
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    size = 0
    for unit in units:
        n = sum(s.nbytes for s in unit)
        if current and size + n > limit:
            buckets.append(Bucket(len(buckets), tuple(current)))
            current, size = [], 0
        current.extend(unit)
        size += n
    if current:
        buckets.append(Bucket(len(buckets), tuple(current)))
    return buckets
