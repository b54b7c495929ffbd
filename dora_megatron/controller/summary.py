"""The run summary: the metrics recorder's figures, then what only the controller's components know
(the pool, the checksums, the moves, the end of the run).

WHY a module of its own: the summary is read from every component and owned by none; gathering it
in one function keeps each component's counters where they are counted and the summary's keys in
one place (DESIGN section 11 lists them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.summary import RunTotals
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.rollout.speculation import speculation_summary

if TYPE_CHECKING:
    from dora_megatron.controller.evaluation import Evaluator
    from dora_megatron.controller.generation import Generation
    from dora_megatron.controller.loop_lag import LoopLag
    from dora_megatron.controller.migration import Migrations
    from dora_megatron.controller.pool import Pool
    from dora_megatron.controller.records import Engine
    from dora_megatron.controller.replay import JournalReplay
    from dora_megatron.controller.stats import StatsPoller
    from dora_megatron.controller.training import Training
    from dora_megatron.controller.turns import Turns
    from dora_megatron.controller.weight_sync import WeightSync
    from dora_megatron.workflow.runner import WorkflowRunner


def run_summary(wall: float, *, orch: Orchestrator, metrics: MetricsRecorder, engines: dict[str, Engine],
                moves: Migrations, weights: WeightSync, generation: Generation, pool: Pool, stats: StatsPoller,
                replay: JournalReplay, training: Training, turns: Turns, loop_lag: LoopLag,
                evaluator: Evaluator | None, workflow: WorkflowRunner | None,
                connection_waits: Callable[[], int] | None) -> dict[str, Any]:
    """The recorder's metrics, then facts of this run only the components know (instances,
    checksums, moves, the end of the run). ``connection_waits``: this process's back-pressure
    count (None: no pooled clients); ``loop_lag``: how late the event loop ran; ``turns``: a
    workflow's prefix KV between turns, carried or computed again."""
    osum = orch.summary()
    totals = RunTotals.of_orchestrator(osum, migrated_kv_bytes=moves.migrated_bytes)
    out = metrics.summary(mode=osum["mode"], max_staleness=osum["max_staleness"], tbs=osum["tbs"],
                          rbs=osum["rbs"], totals=totals, wall_time_s=wall)
    out["migrations_kv"] = moves.migrations_done
    out["migrations_reprefill"] = moves.migrations_fallback
    out["migration_stall_s"] = moves.stall_s
    out["migration_freed_slot_s"] = moves.freed_slot_s
    out["checksum_mismatches"] = weights.checksum_mismatches
    out["checksum_unavailable"] = len(weights.checksum_off)
    out["routed_experts_unavailable"] = len(generation.routed_experts_off)
    out["speculation"] = speculation_summary([stats.spec_totals])
    drafts = generation.drafts  # rollout.speculative=group: finished siblings sent to running ones
    out["speculation"].update(draft_pushes=drafts.calls, draft_sources_taken=drafts.taken,
                              draft_sources_merged=drafts.merged)
    out["version_refusals"] = generation.version_refusals
    out["weight_push_bytes"] = weights.pushed_bytes
    out["instances"] = sorted(engines)  # every instance that was in the pool (joined ones too)
    out["failed_instances"] = sorted(pool.failed_ever)
    out["instances_rejoined"] = pool.rejoins
    out["samples_after_rejoin"] = pool.samples_after_rejoin
    out["engine_restarts"] = pool.engine_restarts
    out["instances_absent_at_start"] = dict(sorted(pool.absent_at_start.items()))
    out["weight_sync_timeouts"] = weights.weight_sync_timeouts
    out["local_resource_errors"] = generation.local_resource_errors
    out["connection_waits"] = connection_waits() if connection_waits is not None else 0
    out["samples_from_journal"] = replay.samples_from_journal
    out.update(loop_lag.summary())  # loop_lag_p99_ms, loop_lag_max_ms
    out["max_live_versions"] = osum.get("max_live_versions")
    out["outstanding_groups_at_end"] = osum["dispatched_groups"] - osum["consumed_groups"]
    if evaluator is not None:
        out.update(evaluator.summary())
    if workflow is not None:
        out.update(workflow.counts)
        out["workflow_turn_moves"] = osum["workflow_turn_moves"]
        out.update(turns.summary())  # the moves' prefix KV: carried or computed again
    out.update(training.status())  # "status", "stopped_by", "stop_checkpoint"
    return out
