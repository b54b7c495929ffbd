"""TurnPacer (dora_megatron.controller.pacing): a wave of request starts is spread over loop turns,
``per_turn`` a turn, in arrival order, with the loop's timers served between two of them; a few
starts pass at once."""

from __future__ import annotations

import asyncio

import pytest

from dora_megatron.controller.pacing import TurnPacer


class TurnCounter:
    """Counts event-loop turns: a callback that re-schedules itself runs once per turn."""

    def __init__(self) -> None:
        self.turn = 0
        self._on = True

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        if self._on:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._on = False


def test_a_wave_of_starts_is_spread_over_turns_in_arrival_order():
    async def main() -> tuple[list[int], list[int], int]:
        pacer, turns, order, timer_turns = TurnPacer(per_turn=16), TurnCounter(), [], []
        turns.start()
        passed_at: list[int] = []

        async def start(i: int) -> None:
            await pacer.turn()
            passed_at.append(turns.turn)
            order.append(i)

        loop = asyncio.get_running_loop()
        loop.call_later(0, lambda: timer_turns.append(turns.turn))  # a due timer, as the lag ticker's
        await asyncio.gather(*(start(i) for i in range(100)))
        turns.stop()
        per_turn = [passed_at.count(t) for t in sorted(set(passed_at))]
        return per_turn, order, timer_turns[0] - min(passed_at)

    per_turn, order, timer_vs_first = asyncio.run(main())
    assert per_turn == [16] * 6 + [4]  # 100 starts, 16 a turn
    assert order == list(range(100))
    assert timer_vs_first <= 1  # the timer ran with the first starts, not after all 100


def test_a_cancelled_waiter_takes_no_room():
    async def main() -> list[tuple[int, int]]:
        pacer, turns, passed = TurnPacer(per_turn=3), TurnCounter(), []
        turns.start()

        async def start(i: int) -> None:
            await pacer.turn()
            passed.append((i, turns.turn))

        tasks = [asyncio.ensure_future(start(i)) for i in range(8)]
        await asyncio.sleep(0)  # 0-2 passed at once, 3-7 wait in the pacer now
        tasks[3].cancel()
        tasks[4].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        turns.stop()
        return passed

    passed = asyncio.run(main())
    assert [i for i, _ in passed] == [0, 1, 2, 5, 6, 7]
    assert len({t for i, t in passed if i >= 5}) == 1  # 5-7 in one turn: the 2 cancelled took no room


def test_per_turn_must_let_someone_through():
    with pytest.raises(ValueError, match="per_turn must be at least 1, got 0"):
        TurnPacer(per_turn=0)
