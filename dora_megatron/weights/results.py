"""What a weight push reports: :class:`PushResult` on success, :class:`PushError` naming the engines
that did not get the weights. Shared by every transport (distributed, disk) so the trainer
service and the controller read one shape whichever path moved the weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dora_megatron.comm.json_value import JSONObject


class PushError(RuntimeError):
    """A push did not reach every engine; ``errors`` maps engine (URL or name) -> message. Engines
    named here may hold partly updated weights: discard them or load a whole version again."""

    def __init__(self, message: str, errors: Mapping[str, str]) -> None:
        detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
        super().__init__(f"{message}: {detail}" if detail else message)
        self.errors = dict(errors)


@dataclass
class PushResult:
    """What one push moved and what the engines report afterwards."""

    transport: str
    version: int | str
    bytes: int
    seconds: float
    num_tensors: int = 0
    num_buckets: int = 0
    connect_seconds: float = 0.0
    checksum: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    group_name: str = ""
    paused: dict[str, JSONObject] = field(default_factory=dict)  # each engine's /pause_generation answer

    @property
    def mb_per_s(self) -> float:
        return self.bytes / (1 << 20) / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {"transport": self.transport, "version": self.version, "bytes": self.bytes, "seconds": self.seconds,
                "num_tensors": self.num_tensors, "num_buckets": self.num_buckets,
                "connect_seconds": self.connect_seconds, "checksum": self.checksum, "versions": self.versions,
                "group_name": self.group_name, "mb_per_s": self.mb_per_s}


def failures(names: Sequence[str], results: Sequence[object]) -> dict[str, str]:
    """``name -> "Type: message"`` for each result of ``gather(..., return_exceptions=True)`` that failed."""
    return {n: f"{type(r).__name__}: {r}" for n, r in zip(names, results) if isinstance(r, BaseException)}
