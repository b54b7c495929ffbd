"""The controller's own loop-lag meter (``summary.json``'s ``loop_lag_p99_ms`` / ``loop_lag_max_ms``):
a callback that holds the loop shows as the run's maximum; an idle loop stays near zero."""

from __future__ import annotations

import asyncio
import time

from dora_megatron.controller.loop_lag import LoopLag


def _measure(block_s: float) -> dict[str, float | None]:
    async def main() -> dict[str, float | None]:
        lag, done = LoopLag(period_s=0.01), asyncio.Event()
        ticker = asyncio.create_task(lag.run(done))
        await asyncio.sleep(0.1)
        if block_s:
            time.sleep(block_s)  # a stall: the loop thread busy, no task runs
        await asyncio.sleep(0.1)
        done.set()
        await ticker
        return lag.summary()

    return asyncio.run(main())


def test_a_stall_of_the_loop_is_the_runs_maximum():
    got = _measure(0.3)
    assert got["loop_lag_max_ms"] >= 250


def test_an_idle_loop_is_not_late():
    got = _measure(0.0)
    assert got["loop_lag_max_ms"] < 250
    assert got["loop_lag_p99_ms"] <= got["loop_lag_max_ms"]


def test_before_the_first_tick_there_is_no_figure():
    assert LoopLag().summary() == {"loop_lag_p99_ms": None, "loop_lag_max_ms": None}
