"""The run's tasks, clock and end (:class:`~dora_megatron.controller.run_tasks.RunTasks`), which
every controller component is handed instead of the runtime: a failing task ends the run with its
cause, the first error wins, an end wakes the loop, and a resumed run's clock goes on from the
checkpoint's wall time."""

from __future__ import annotations

import asyncio

from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.events import Stop


def test_a_failing_task_ends_the_run_with_its_cause_and_the_first_error_wins():
    async def main():
        events = EventQueue()
        tasks = RunTasks(events)

        async def fails():
            raise ValueError("first")

        tasks.spawn(fails(), "fails")
        await asyncio.wait_for(tasks.ended.wait(), timeout=5)
        tasks.stop(RuntimeError("second"))  # a later error does not replace the cause
        event, _, _ = await events.get()
        return tasks, event

    tasks, event = asyncio.run(main())
    assert tasks.is_done() and isinstance(tasks.error, ValueError) and str(tasks.error) == "first"
    assert isinstance(event, Stop)  # the loop, asleep on its queue, wakes to end


def test_cancel_all_ends_every_task_and_the_clock_goes_on_from_the_resumed_wall_time():
    async def main():
        tasks = RunTasks(EventQueue())
        tasks.resumed_from_s = 100.0
        tasks.start_clock()
        started = tasks.now()
        tasks.spawn(asyncio.sleep(60), "sleeps")
        await asyncio.sleep(0)  # it started: cancelling it ends a running task, not one never run
        running = tasks.running
        await tasks.cancel_all()
        return tasks, started, running

    tasks, started, running = asyncio.run(main())
    assert 100.0 <= started < 101.0
    assert len(running) == 1 and running[0].cancelled() and tasks.running == ()
    assert tasks.error is None and not tasks.is_done()  # cancelling is not an end nor an error
