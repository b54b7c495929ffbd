"""Events below both drivers: the records of what happened (:mod:`.event`) and the one mapping
onto the sans-IO orchestrator (:mod:`.mapping`). The runtime (:mod:`dora_megatron.controller`) and
the simulator (:mod:`dora_megatron.sim`) both use this package; neither owns it."""

from dora_megatron.events.event import (CheckpointSaved, EngineReply, Event, InstanceFailed, InstanceJoined, InstanceStats,
                                        MigrationDone, MigrationFailed, Replayed, Resume, SampleProgress, Start, Stop,
                                        SwitchDone, Tick, TrainerDone, TurnEnded, TurnReady)
from dora_megatron.events.mapping import EventMapping, Executor

__all__ = ["CheckpointSaved", "EngineReply", "Event", "EventMapping", "Executor", "InstanceFailed", "InstanceJoined",
           "InstanceStats", "MigrationDone", "MigrationFailed", "Replayed", "Resume", "SampleProgress", "Start", "Stop",
           "SwitchDone", "Tick", "TrainerDone", "TurnEnded", "TurnReady"]
