"""The run's end: in-flight tasks cancelled a batch per loop turn, the collector paused meanwhile."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dora_megatron.controller.shutdown import cancel_in_batches, collector_paused


async def _turns_per_cancel(n: int, batch: int) -> list[int]:
    """The loop turn (counted by a ticker that yields every turn) at which each of ``n`` waiting
    tasks saw its cancellation."""
    turn = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal turn
        while not stop.is_set():
            turn += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    async def waiter() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(turn)
            raise

    tick = asyncio.create_task(ticker())
    tasks = [asyncio.create_task(waiter()) for _ in range(n)]
    await asyncio.sleep(0)  # every waiter is waiting
    await cancel_in_batches(tasks, batch)
    stop.set()
    await tick
    assert all(t.cancelled() for t in tasks)
    return seen


def test_cancels_a_batch_per_loop_turn() -> None:
    seen = asyncio.run(_turns_per_cancel(1000, 100))
    assert len(seen) == 1000
    per_turn = {t: seen.count(t) for t in set(seen)}
    assert max(per_turn.values()) <= 100
    assert len(per_turn) >= 10  # spread over at least ten turns


def test_one_batch_cancels_all_in_one_turn() -> None:
    """The same measure distinguishes: everything in one batch lands in one turn."""
    seen = asyncio.run(_turns_per_cancel(1000, 1000))
    assert len(set(seen)) == 1


def test_a_failing_task_does_not_fail_the_caller() -> None:
    async def main() -> asyncio.Task[None]:
        async def fails_on_cancel() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise RuntimeError("clean-up failed") from None

        task = asyncio.create_task(fails_on_cancel())
        await asyncio.sleep(0)
        await cancel_in_batches([task], 4)
        return task

    task = asyncio.run(main())
    assert isinstance(task.exception(), RuntimeError)


def test_bad_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch must be at least 1, got 0"):
        asyncio.run(cancel_in_batches([], 0))


def test_collector_paused_and_restored() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a process that had it off keeps it off
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(KeyError):  # restored on an error too
            with collector_paused():
                raise KeyError("x")
        assert gc.isenabled()
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
