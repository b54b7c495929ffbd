"""The controller loop (controller/loop.py) is the only caller of the orchestrator's event
methods: engine replies, stats, switches, trainer results and failures reach it as events on one
queue, whatever task saw them."""

from __future__ import annotations

import asyncio

from dora_megatron.controller.main import drive

from tests.helpers.fakes import fail_after_first_step
from tests.helpers.orchestrator_spy import CallerCheckingOrchestrator
from tests.helpers.runtime import check_run, make


def test_only_the_loop_calls_the_orchestrator_even_with_failures_and_a_rejoin():
    spies: list[CallerCheckingOrchestrator] = []
    rt, engines, trainer = make(mode="dora", n=3, steps=6, token_s=0.003,
                                orchestrator=lambda made: spies.append(CallerCheckingOrchestrator(made)) or spies[-1])
    spy = spies[0]
    back = type(engines["e1"])("e1-back", token_s=0.003)

    async def main():
        async def kill_then_rejoin():
            await fail_after_first_step(rt, trainer, engines["e1"], "e1")
            rt.add_instance("e1", back)
        asyncio.get_running_loop().create_task(kill_then_rejoin())
        return await asyncio.wait_for(drive(rt), timeout=120)

    summary = asyncio.run(main())
    check_run(rt, {**engines, "e1-back": back}, trainer, 6, 4, 2)
    assert summary["failed_instances"] == ["e1"] and summary["instances_rejoined"] == 1
    # the run exercised the main event kinds, each through the loop only
    assert {"start", "on_sample_finished", "on_instance_stats", "on_tick", "on_switch_done", "on_step_finished",
            "on_instance_failed", "on_instance_joined"} <= set(spy.callers)
    callers = {c for cs in spy.callers.values() for c in cs}
    assert {c.split(".")[0] for c in callers} == {"ControllerLoop"}, spy.callers


def test_report_returns_after_its_event_was_applied_and_a_cancelled_reporter_withdraws_it():
    """Per-sample ordering rests on this: a task that awaited ``report`` has had its event applied;
    one cancelled first (its instance failed) never reaches the orchestrator."""
    from dora_megatron.events import Stop, Tick
    from dora_megatron.controller.loop import ControllerLoop, EventQueue

    class Orch:
        def __init__(self):
            self.ticks = []

        def on_tick(self, now):
            self.ticks.append(now)
            return []

    class Executor:
        def now(self):
            return float(len(orch.ticks))

        def execute(self, actions):
            raise AssertionError("no actions expected")

    orch = Orch()

    async def go():
        events, done = EventQueue(), asyncio.Event()
        withdrawn = asyncio.get_running_loop().create_task(events.report(Tick()))
        await asyncio.sleep(0)  # its event is queued
        withdrawn.cancel()
        loop = asyncio.get_running_loop().create_task(ControllerLoop(orch, Executor(), events, done).run())
        await events.report(Tick())
        seen = list(orch.ticks)  # applied before report returned
        done.set()
        events.post(Stop())
        await asyncio.wait_for(loop, timeout=10)
        return seen

    assert asyncio.run(go()) == [0.0]
    assert orch.ticks == [0.0]


def test_a_report_after_the_loop_ended_is_cancelled_not_left_waiting():
    """A task that reports once the loop has stopped (on Python 3.11 a shutdown cancel can be lost
    inside ``asyncio.wait_for``) is cancelled: it used to wait forever and hang the run's end."""
    from dora_megatron.events import Stop, Tick
    from dora_megatron.controller.loop import ControllerLoop, EventQueue

    async def main():
        events, done = EventQueue(), asyncio.Event()
        waiting = asyncio.get_running_loop().create_task(events.report(Tick()))
        await asyncio.sleep(0)  # queued, not yet applied
        done.set()
        events.post(Stop())
        await ControllerLoop(None, None, events, done).run()  # done already set: applies nothing
        try:
            await asyncio.wait_for(waiting, timeout=5)
        except asyncio.CancelledError:
            pass
        assert waiting.cancelled()
        late = asyncio.get_running_loop().create_task(events.report(Tick()))
        try:
            await asyncio.wait_for(late, timeout=5)
        except asyncio.CancelledError:
            pass
        assert late.cancelled()

    asyncio.run(main())
