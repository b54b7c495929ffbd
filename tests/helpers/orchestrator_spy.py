"""An orchestrator wrapper that records who called each of its event methods: the controller loop
and the simulator must reach the orchestrator only through the one event mapping
(``events/mapping.py::EventMapping``)."""

from __future__ import annotations

import sys

EVENT_METHODS = ("start", "on_tick", "on_sample_progress", "on_sample_finished", "on_sample_versions",
                 "on_instance_stats",
                 "on_step_finished", "on_instance_failed", "on_instance_joined", "on_switch_done",
                 "on_migration_done", "on_migration_failed", "on_turn_ended", "on_turn_ready", "set_prompt_tokens", "poll")


class CallerCheckingOrchestrator:
    """Forwards to the real orchestrator and records who called each event method."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.callers: dict[str, set[str]] = {}

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in EVENT_METHODS:
            return attr

        def call(*args, **kw):
            frame = sys._getframe(1)
            owner = type(frame.f_locals.get("self")).__name__
            self.callers.setdefault(name, set()).add(f"{owner}.{frame.f_code.co_name}")
            return attr(*args, **kw)

        return call
