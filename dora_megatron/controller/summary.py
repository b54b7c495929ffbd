"""The run summary: the metrics recorder's figures, then what only the controller's components know
(the pool, the checksums, the moves, the end of the run).

WHY a module of its own: the summary is read from every component and owned by none; gathering it
in one function keeps each component's counters where they are counted and the summary's keys in
one place (DESIGN section 11 lists them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

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


class SummaryHost(Protocol):
    """What the summary reads of the executor: the orchestrator, the recorder and the components."""

    orch: Orchestrator
    metrics: MetricsRecorder
    engines: dict[str, Engine]
    moves: Migrations
    weights: WeightSync
    generation: Generation
    pool: Pool
    stats: StatsPoller
    replay: JournalReplay
    training: Training
    turns: Turns  # a workflow's prefix KV between turns: carried or computed again
    evaluator: Evaluator | None
    workflow: WorkflowRunner | None
    connection_waits: Callable[[], int] | None  # this process's back-pressure count (None: no pooled clients)
    loop_lag: LoopLag  # how late the event loop ran


def run_summary(rt: SummaryHost, wall: float) -> dict[str, Any]:
    """The recorder's metrics, then facts of this run only the runtime knows (instances, checksums)."""
    osum = rt.orch.summary()
    totals = RunTotals.of_orchestrator(osum, migrated_kv_bytes=rt.moves.migrated_bytes)
    out = rt.metrics.summary(mode=osum["mode"], max_staleness=osum["max_staleness"], tbs=osum["tbs"],
                             rbs=osum["rbs"], totals=totals, wall_time_s=wall)
    out["migrations_kv"] = rt.moves.migrations_done
    out["migrations_reprefill"] = rt.moves.migrations_fallback
    out["migration_stall_s"] = rt.moves.stall_s
    out["migration_freed_slot_s"] = rt.moves.freed_slot_s
    out["checksum_mismatches"] = rt.weights.checksum_mismatches
    out["checksum_unavailable"] = len(rt.weights.checksum_off)
    out["routed_experts_unavailable"] = len(rt.generation.routed_experts_off)
    out["speculation"] = speculation_summary([rt.stats.spec_totals])
    drafts = rt.generation.drafts  # rollout.speculative=group: finished siblings sent to running ones
    out["speculation"].update(draft_pushes=drafts.calls, draft_sources_taken=drafts.taken,
                              draft_sources_merged=drafts.merged)
    out["version_refusals"] = rt.generation.version_refusals
    out["weight_push_bytes"] = rt.weights.pushed_bytes
    out["instances"] = sorted(rt.engines)  # every instance that was in the pool (joined ones too)
    out["failed_instances"] = sorted(rt.pool.failed_ever)
    out["instances_rejoined"] = rt.pool.rejoins
    out["samples_after_rejoin"] = rt.pool.samples_after_rejoin
    out["engine_restarts"] = rt.pool.engine_restarts
    out["instances_absent_at_start"] = dict(sorted(rt.pool.absent_at_start.items()))
    out["weight_sync_timeouts"] = rt.weights.weight_sync_timeouts
    out["local_resource_errors"] = rt.generation.local_resource_errors
    waits = rt.connection_waits
    out["connection_waits"] = waits() if waits is not None else 0
    out["samples_from_journal"] = rt.replay.samples_from_journal
    out.update(rt.loop_lag.summary())  # loop_lag_p99_ms, loop_lag_max_ms
    out["max_live_versions"] = osum.get("max_live_versions")
    out["outstanding_groups_at_end"] = osum["dispatched_groups"] - osum["consumed_groups"]
    if rt.evaluator is not None:
        out.update(rt.evaluator.summary())
    if rt.workflow is not None:
        out.update(rt.workflow.counts)
        out["workflow_turn_moves"] = osum["workflow_turn_moves"]
        out.update(rt.turns.summary())  # the moves' prefix KV: carried or computed again
    out.update(rt.training.status())  # "status", "stopped_by", "stop_checkpoint"
    return out
