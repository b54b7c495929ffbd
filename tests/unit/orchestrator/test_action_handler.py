"""One action protocol, three executors: the runtime, the simulator and the test driver each
implement :class:`ActionHandler` (a method per action), and :func:`perform` is the one place that
maps an action to its method."""

from __future__ import annotations

import inspect

import pytest

from dora_megatron.orchestrator import (ActionHandler, Dispatch, Interrupt, Migrate, ReleaseBatch, Submit,
                                        SwitchVersion, perform)

METHODS = {Dispatch: "dispatch", Submit: "submit", Migrate: "migrate", Interrupt: "interrupt",
           SwitchVersion: "switch_version", ReleaseBatch: "release_batch"}


def _drivers():
    from dora_megatron.controller.runtime import Runtime
    from dora_megatron.sim.engine import Simulation

    from .sim_driver import Driver

    return [Runtime, Simulation, Driver]


@pytest.mark.parametrize("driver", _drivers(), ids=lambda c: c.__name__)
def test_every_driver_has_a_method_per_action(driver):
    for name in METHODS.values():
        method = getattr(driver, name, None)
        assert callable(method), f"{driver.__name__} lacks {name}"
        assert list(inspect.signature(method).parameters) == ["self", "a"]
    assert set(METHODS.values()) == {n for n in dir(ActionHandler) if not n.startswith("_")}


def test_perform_calls_the_method_of_each_action_in_order():
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda a: calls.append((name, a))

    actions = [Dispatch("g0", 0, ("s0", "s1")), Submit("s0", "i0", 0), Migrate("s0", "i0", "i1", 0),
               Interrupt("s1", "i0"), SwitchVersion("i0", 1), ReleaseBatch(0, ("g0",), (0,))]
    perform(Recorder(), actions)
    assert calls == [(METHODS[type(a)], a) for a in actions]
    with pytest.raises(TypeError, match="unknown action"):
        perform(Recorder(), ["not an action"])
