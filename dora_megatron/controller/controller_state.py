"""The controller part of a checkpoint: what ``controller.json`` holds, cut at a step boundary, and
the run continued from it on resume.

WHY a module of its own: what a checkpoint *holds* is the state of several components (the sample
store's outstanding groups, the step count, the migration counters, the checksums instances may
still load, the metrics recorder's totals) beside the orchestrator's snapshot; this is the one
place that gathers it and gives it back, so nothing is saved twice and nothing is forgotten.
How the files reach the disk is :mod:`.checkpointing`'s (and :mod:`.state_file`'s); what the
checkpoint is sized by is DESIGN section 5.5.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.observability.recorder import MetricsRecorder

if TYPE_CHECKING:
    from dora_megatron.controller.checkpointing import CheckpointWriter
    from dora_megatron.controller.journal import Journal
    from dora_megatron.controller.migration import Migrations
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.controller.training import Training
    from dora_megatron.controller.turns import Turns
    from dora_megatron.controller.weight_sync import WeightSync

log = logging.getLogger(__name__)

#: the layout of ``controller.json`` :meth:`ControllerState.state_dict` writes, the only one read
STATE_FORMAT = 2
#: the keys it always writes (a file without one is not this version's)
STATE_KEYS = ("format", "version", "pending_step_finished", "next_prompt", "wall_s", "orchestrator", "groups",
              "samples", "steps_done", "metrics", "migrated_bytes", "migrations_done", "migrations_fallback",
              "migration_stall_s", "migration_freed_slot_s", "workflow_turns", "expected_checksums")
#: what an older dora's ``controller.json`` held instead, named in the refusal (never read)
_OLD_LAYOUT = {"steps": "a list of step logs (now steps.jsonl's, with 'steps_done' their count)",
               "consumed": "the consumed groups (now consumed.jsonl's)",
               "c1_count": "C1 and duplicate counts (now the orchestrator snapshot's)",
               "duplicated": "C1 and duplicate counts (now the orchestrator snapshot's)"}


def check_format(state: Mapping[str, Any]) -> None:
    """Refuse a ``controller.json`` this version did not write, with a ``ValueError`` saying what is
    old (the caller names the file). WHY one check up front: a 0.1 project keeps one format and no
    reader of older ones; without it an older file fails later on a bare ``KeyError`` that names no
    file, or half-loads into records that differ from the run that wrote it."""
    old = sorted({why for key, why in _OLD_LAYOUT.items() if key in state})
    if isinstance(state.get("metrics"), Mapping) and "rows" in state["metrics"]:
        old.append("the recorder's step rows in 'metrics' (now steps.jsonl's)")
    missing = [key for key in STATE_KEYS if key not in state]
    if state.get("format") == STATE_FORMAT and not missing and not old:
        return
    what = [f"format {state.get('format')!r}, not {STATE_FORMAT}"] if state.get("format") != STATE_FORMAT else []
    what += [f"no {', '.join(repr(k) for k in missing)}"] if missing else []
    raise ValueError("; ".join(what + old) + ": written by an older dora; this version cannot resume from it "
                     "(start a new run)")


class ControllerState:
    """Cuts and restores the controller part of a checkpoint: the state of the ``store`` (the
    outstanding samples), ``training`` (the step count, a stop's checkpoint), ``moves`` (the
    migration counters), ``weights`` (the checksums instances may load, the trainer's newest
    version), ``turns`` (the workflows' prefix KV between turns) and ``metrics``; ``tasks``: the
    clock (a resumed run's goes on from the checkpoint's wall time); ``checkpoints``: the files;
    ``journal`` (None: none). ``on_checkpoint(version)``: at each checkpoint's cut (the launcher's
    snapshot retention)."""

    def __init__(self, *, store: SampleStore, training: Training, moves: Migrations, weights: WeightSync,
                 turns: Turns, metrics: MetricsRecorder, checkpoints: CheckpointWriter, tasks: RunTasks,
                 journal: Journal | None, on_checkpoint: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.training = training
        self.moves = moves
        self.weights = weights
        self.turns = turns
        self.metrics = metrics
        self.checkpoints = checkpoints
        self.tasks = tasks
        self.journal = journal
        self.on_checkpoint = on_checkpoint
        #: the version whose ``on_step_finished`` the checkpoint was cut before (replayed on resume)
        self.pending_step_finished: int | None = None
        self.resumed = False

    def write(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        """Loop (:class:`CheckpointSaved`): the controller part, taken before ``on_step_finished``
        so the orchestrator is at a step boundary.

        The state is cut in this loop turn (with the journal's marker, which splits exactly
        there); its encoding and files are written by a task a chunk per loop turn
        (:mod:`.state_file`: at thousands of instances one ``json.dumps`` of it held the loop for
        up to a second), chained after any earlier one. The run's last checkpoint is waited for
        at the run's end, off the loop (the run ends right after and cancels its tasks; its
        failure fails the run).
        ``controller.json`` is written last and atomically: a checkpoint directory without it is
        incomplete and ignored by resume, which then falls back one checkpoint (the journal keeps
        the records since the one before, :mod:`.journal`). Just before it, ``manifest.json``
        (sizes and SHA-256 of the trainer's files and of ``controller.json``) lets resume detect a
        corrupt checkpoint."""
        path = self.checkpoints.path(version)
        state = self.state_dict(version, orchestrator_snapshot)

        spool = self.store.routed_spool  # holds the routed experts the state names (routed_at)

        def complete() -> None:
            log.info("checkpoint v%d written to %s", version, path)
            if self.journal is not None:
                self.journal.completed(version)
            if spool is not None:
                spool.checkpoint_completed(version)

        writer = self.checkpoints.start_state(version, state, complete)
        if spool is not None:
            # the spool's writes the state names are in their files before controller.json is
            # (the state writer's thread waits for them), and the spool keeps what the state names
            writer = _after_flush(spool.flush, writer)
            spool.checkpoint_cut(version)
        if self.journal is not None:
            self.journal.checkpoint(version)
        if self.on_checkpoint is not None:
            # in the turn of the cut too: the launcher's snapshot retention records the live
            # versions the checkpoint holds (later they have moved on, and a snapshot it needs
            # would be pruned); it keeps the previous checkpoint's as well, the fallback while
            # this one is being written
            self.on_checkpoint(version)
        self.training.checkpoint_cut(version)  # on a stop, the one --resume goes on from: the run ends in this turn
        self.checkpoints.finish(version, writer, last=self.training.is_last())

    def state_dict(self, version: int, orchestrator_snapshot: dict[str, Any]) -> dict[str, Any]:
        """The controller part of a checkpoint, sized by outstanding work (DESIGN section 5.5): the
        outstanding groups' prompts, the finished samples' outputs, counters, the number of steps done.

        WHY nothing per step: the step logs and the metrics recorder's per-step rows are
        ``steps.jsonl``'s (:meth:`load_state_dict` takes them back from it), and the orchestrator
        snapshot already lists every outstanding group and sample with its version and ids; what is
        kept here is only what it does not hold (prompt and output tokens, rewards). Unfinished
        samples restart from their prompt on their own version (C1), so they need no entry."""
        groups, samples = self.store.state_entries()
        # the checksums an instance may still load after a resume: the versions of outstanding work
        # and the newest (older ones are never switched to again)
        oldest = min((int(g["version"]) for g in orchestrator_snapshot["groups"]), default=version)
        return {
            "format": STATE_FORMAT, "version": version, "pending_step_finished": version,
            "next_prompt": self.store.next_prompt, "wall_s": self.tasks.now(),
            "orchestrator": orchestrator_snapshot,
            "groups": groups, "samples": samples,
            "steps_done": self.training.steps_done,
            "metrics": self.metrics.state_dict(), "migrated_bytes": self.moves.migrated_bytes,
            "migrations_done": self.moves.migrations_done, "migrations_fallback": self.moves.migrations_fallback,
            "migration_stall_s": self.moves.stall_s, "migration_freed_slot_s": self.moves.freed_slot_s,
            "workflow_turns": self.turns.summary(),
            "expected_checksums": {str(k): v for k, v in self.weights.expected_checksums.items()
                                   if k >= min(oldest, version)},
        }

    def load_state_dict(self, state: dict[str, Any], step_rows: Sequence[dict[str, Any]] = ()) -> None:
        """Continue from :meth:`state_dict`: unfinished samples of unconsumed groups are re-run on
        their own version; every instance is fresh and is switched to the version it is given.
        ``step_rows``: the metrics recorder's rows of the steps done, as ``steps.jsonl`` has them
        (:func:`~dora_megatron.observability.recorder.read_step_rows`; the summary of the resumed
        run covers the whole run). A file another dora wrote is refused (:func:`check_format`)."""
        check_format(state)
        self.store.load_entries(state)
        self.tasks.resumed_from_s = float(state["wall_s"])  # the clock goes on from it
        # consumed groups are not carried (consumed.jsonl lists them): the restored orchestrator has
        # forgotten them, so none can be released again; the step logs are steps.jsonl's
        self.training.steps_done = int(state["steps_done"])
        self.metrics.load_state_dict(state["metrics"], rows=step_rows)
        self.moves.migrated_bytes = int(state["migrated_bytes"])
        self.moves.migrations_done = int(state["migrations_done"])
        self.moves.migrations_fallback = int(state["migrations_fallback"])
        self.moves.stall_s = float(state["migration_stall_s"])
        self.moves.freed_slot_s = float(state["migration_freed_slot_s"])
        self.turns.load(state["workflow_turns"])
        self.weights.expected_checksums = {int(k): v for k, v in state["expected_checksums"].items()}
        self.pending_step_finished = state["pending_step_finished"]
        self.weights.latest_version = int(state["version"])
        self.resumed = True


def _after_flush(flush: Callable[[], None], writer: Iterator[None]) -> Iterator[None]:
    """``writer``'s steps, run once ``flush()`` returned (it raises a failed spool write: the
    checkpoint then fails rather than name ids that are not on disk)."""
    flush()
    yield from writer
