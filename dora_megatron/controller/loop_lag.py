"""How late the controller's event loop runs: a ticker's lateness, reported in ``summary.json``.

WHY in every run: every dispatch, migration, stats poll and weight switch of the whole cluster
waits for the loop, so a loop that stalls for seconds delays all of them at once (a lag p99 of
4.7 s was measured at reasoning lengths before the data plane moved off it). ``tools/controller_scale.py``
measures it against fake fleets; this meter gives every real job the same two numbers
(``loop_lag_p99_ms``, ``loop_lag_max_ms``) at the cost of one timer every 20 ms.
"""

from __future__ import annotations

import asyncio
from array import array

#: seconds between two ticks
LAG_PERIOD_S = 0.02


class LoopLag:
    """The lateness of each tick of :meth:`run` (4 bytes a tick: 0.7 MB a hour)."""

    def __init__(self, period_s: float = LAG_PERIOD_S) -> None:
        self.period_s = period_s
        self.lags = array("f")  # seconds each tick came late

    async def run(self, done: asyncio.Event) -> None:
        """Tick until ``done`` is set (the run ended)."""
        loop = asyncio.get_running_loop()
        while not done.is_set():
            due = loop.time() + self.period_s
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, loop.time() - due))

    def summary(self) -> dict[str, float | None]:
        """``loop_lag_p99_ms`` and ``loop_lag_max_ms`` of the run (None: no tick yet)."""
        if not self.lags:
            return {"loop_lag_p99_ms": None, "loop_lag_max_ms": None}
        ordered = sorted(self.lags)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return {"loop_lag_p99_ms": round(1000 * p99, 1), "loop_lag_max_ms": round(1000 * ordered[-1], 1)}
