"""A deterministic discrete-event queue on a virtual clock.

WHY a sequence number: ``heapq`` compares tuples element-wise, so two events at the same time
would fall through to comparing payloads (non-deterministic or a TypeError). Ties are broken by
insertion order instead, which makes a run a pure function of its config and seed.
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """Min-heap of ``(time, seq, kind, payload)``."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0

    def push(self, time: float, kind: str, payload: Any = None) -> None:
        if time < self.now:
            time = self.now
        heapq.heappush(self._heap, (time, self._seq, kind, payload))
        self._seq += 1

    def pop(self) -> tuple[float, str, Any]:
        time, _, kind, payload = heapq.heappop(self._heap)
        self.now = time
        return time, kind, payload

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
