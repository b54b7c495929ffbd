"""The trainer step: the released batch handed to ``/train``, the step's log, whether a checkpoint
is due, the end of the run and a stop asked from outside.

WHY a component of its own: the step is where the run's pace and its end are decided. The
orchestrator decides *which* groups form a batch (:class:`~dora_megatron.orchestrator.ReleaseBatch`);
this component hands them to the trainer, records what the step cost (the trainer's idle wait,
its train and export time), decides whether a checkpoint is due at this boundary (the interval,
the last step, or a stop request) and whether the run ends there. The executor
(:class:`~dora_megatron.controller.runtime.Runtime`) hands it the ``ReleaseBatch`` action and the
:class:`~dora_megatron.events.TrainerDone` event and asks it at each step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.events import TrainerDone
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.records import RunPaths, Trainer
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.summary import StepRecord
from dora_megatron.orchestrator import Orchestrator, ReleaseBatch

if TYPE_CHECKING:
    from dora_megatron.controller.evaluation import Evaluator
    from dora_megatron.controller.migration import Migrations
    from dora_megatron.controller.samples import ReleasedBatch, SampleStore
    from dora_megatron.observability.rollout_dump import RolloutDumper
    from dora_megatron.observability.timeline import Timeline

log = logging.getLogger(__name__)


class Training:
    """Carries out :class:`ReleaseBatch` actions and logs each trained step (DESIGN section 5.3);
    ``run``: the config's section (``steps``, ``checkpoint_interval``);
    ``controller``: the config's section (``stop_checkpoint_timeout_s``); ``paths``: whether the run
    writes checkpoints (:attr:`RunPaths.checkpoints`); ``on_step(record, metrics)``: after each step's
    record (the launcher's outputs; the run's records are the recorder's, ``metrics.rows``).
    ``store`` hands over the batch, ``trainer`` trains it, ``metrics`` records the step (with the
    ``orch``'s counters and the bytes the ``moves`` migrated); ``tasks``: the clock, the trainer's
    task and the end of the run; ``timeline`` and ``rollout_dump`` (None: none). The eval rounds,
    built after it, come through :meth:`use_evaluator`."""

    def __init__(self, run: RunConfig, controller: ControllerConfig, paths: RunPaths, *, orch: Orchestrator,
                 trainer: Trainer, store: SampleStore, events: EventQueue, metrics: MetricsRecorder,
                 moves: Migrations, tasks: RunTasks, timeline: Timeline | None, rollout_dump: RolloutDumper | None,
                 on_step: Callable[[StepRecord, MetricsRecorder], None] | None = None) -> None:
        self.orch = orch
        self.trainer = trainer
        self.store = store
        self.events = events
        self.metrics = metrics
        self.moves = moves
        self.tasks = tasks
        self.timeline = timeline
        self.rollout_dump = rollout_dump
        #: the eval rounds (``data.eval_path``; None: no eval set): a round after each step that asks for one
        self.evaluator: Evaluator | None = None
        self.run = run
        self.controller = controller
        self.paths = paths
        self.on_step = on_step
        self.steps_done = 0  # steps of the run so far, resumed ones included
        #: a stop asked from outside (the launcher's first SIGINT/SIGTERM/SIGUSR1): its reason, and the
        #: version of the checkpoint written for it (None: none yet, or the step was abandoned)
        self.stop_reason: str | None = None
        self.stop_checkpoint: int | None = None
        self._stop_at_boundary = False
        self._trainer_idle_since = 0.0

    def use_evaluator(self, evaluator: Evaluator) -> None:
        """The eval rounds started after a step. WHY after construction: the
        :class:`~dora_megatron.controller.evaluation.Evaluator` needs the weight sync (its final
        round's loads), which is built after this component; it is handed here once it exists."""
        self.evaluator = evaluator

    def idle_since(self, t: float) -> None:
        """The trainer waits for its first batch from ``t`` (the run's start, or its resume)."""
        self._trainer_idle_since = t

    def release_batch(self, a: ReleaseBatch) -> None:
        """Hand the batch to the trainer: the groups are consumed now (exactly once), ``/train`` runs
        in a task that reports :class:`TrainerDone`."""
        start = self.tasks.now()
        wait = max(0.0, start - self._trainer_idle_since)
        samples, batch, dumped = self.store.take_batch(a, wait, dump=self.rollout_dump is not None)
        if self.rollout_dump is not None:
            self.rollout_dump.dump(a.step, dumped)
        self.tasks.spawn(self._train(a.step, samples, start, batch), f"train-{a.step}")

    async def _train(self, step: int, samples: list[TrainSample], start: float, batch: ReleasedBatch) -> None:
        """``batch``: what the store noted of it (:class:`~dora_megatron.controller.samples.ReleasedBatch`)."""
        t_train = time.monotonic()
        result = await self.trainer.train(step, samples)
        train_s = time.monotonic() - t_train
        trained = self.tasks.now()
        # the trainer's own measures when it reports them: /train includes the snapshot export
        export_s = min(float(result.get("export_s") or 0.0), train_s)
        self.metrics.trainer_sync(trained - export_s, trained)
        train_s = float(result.get("train_s", train_s - export_s))
        await self.events.report(TrainerDone(step, result, start, train_s, batch))

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        """Loop (:class:`TrainerDone`): log the step; returns the new weights' version and whether a
        checkpoint is due (then its trainer part is to be written and :class:`CheckpointSaved` follows)."""
        result, b = ev.result, ev.batch
        new_version = int(result["version"])
        end = self.tasks.now()
        metrics = dict(result.get("metrics", {}))
        if result.get("padding_fraction") is not None:  # a trainer that packs reports it beside its metrics
            metrics["padding_fraction"] = result["padding_fraction"]
        oc = self.orch.counters
        self.metrics.step_trained(
            ev.step, end_s=end, wait_s=b.wait_s, train_s=ev.train_s, tokens=b.tokens, staleness=b.staleness,
            rewards=b.rewards, response_lengths=b.lengths, live_versions=live_versions, metrics=metrics,
            migrations=oc.migrations, migrated_kv_bytes=self.moves.migrated_bytes, reprefill_tokens=oc.reprefill_tokens,
            reward_errors=b.reward_errors, groups=b.group_ids, versions=b.versions)
        record = self.metrics.rows[-1]
        # the orchestrator numbers steps from 0 (its step counter, restored with it on resume):
        # trained step ``ev.step`` makes ``ev.step + 1`` steps done
        self.steps_done = ev.step + 1
        if self.timeline is not None:
            self.timeline.span("trainer", f"step {ev.step}", ev.start, end, version=ev.step, kind="train",
                             produced=new_version)
        if self.on_step is not None:
            self.on_step(record, self.metrics)
        self._trainer_idle_since = end
        finished = self.steps_done >= self.run.steps
        last = finished or self.stop_reason is not None  # a stop ends the run here
        if self.evaluator is not None:  # a round of these weights, beside the rollout (or the final one)
            self.evaluator.after_step(self.steps_done, new_version, finished)
        interval = self.run.checkpoint_interval
        due = self.paths.checkpoints and (last or bool(interval and new_version % interval == 0))
        if due and self.stop_reason is not None:
            self._stop_at_boundary = True  # the step ended in time: its checkpoint is not abandoned
        return new_version, due

    def is_last(self) -> bool:
        """Whether the run ends at this step boundary: every step done, or a stop was asked."""
        return self.steps_done >= self.run.steps or self.stop_reason is not None

    def checkpoint_cut(self, version: int) -> None:
        """Checkpoint ``version`` was cut: on a stop request it is the one ``--resume`` goes on from."""
        if self.stop_reason is not None:
            self.stop_checkpoint = version  # the run ends in this turn; its end waits for the file

    def step_boundary(self) -> bool:
        """Loop: after a step (and its checkpoint): True when it was the last one, or a stop was
        asked (the run ends; its checkpoint was cut in this turn, the run's end waits for its file)."""
        if self.is_last():
            self.tasks.stop()
            return True
        return False

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary with a checkpoint there (``reason``: e.g. ``SIGINT``),
        whatever ``checkpoint_interval`` says, so that ``--resume`` loses nothing.

        WHY at a boundary: a checkpoint is a cut where weights ``v`` exist and the orchestrator has
        not reacted to them; mid-step there is no such cut. Bounded: when no step ends within
        ``stop_checkpoint_timeout_s`` the step is abandoned (the run stops without a new
        checkpoint; the last complete one stays, ``--resume`` redoes what came after it). Only the
        first request counts (a second signal is the launcher's: it exits at once)."""
        if self.stop_reason is not None or self.tasks.is_done():
            return
        self.stop_reason = reason
        timeout = self.controller.stop_checkpoint_timeout_s
        log.warning("stop asked (%s): checkpoint at the end of the current step (at most %.0f s, "
                    "controller.stop_checkpoint_timeout_s), then exit", reason, timeout)
        self.tasks.spawn(self._abandon_after(timeout), "stop-timeout")

    async def _abandon_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if not self._stop_at_boundary and not self.tasks.is_done():
            log.warning("stop (%s): no step boundary within %.0f s (controller.stop_checkpoint_timeout_s): the "
                        "step is abandoned; the last complete checkpoint stays", self.stop_reason, timeout_s)
            self.tasks.stop()

    def status(self) -> dict[str, Any]:
        """The summary's end of the run: ``status`` is "completed"; "stopped" (a stop request:
        checkpoint ``stop_checkpoint`` written, ``--resume`` goes on from it); or
        "stopped_without_checkpoint" (the step was abandoned: the last complete checkpoint stays)."""
        status = ("completed" if self.stop_reason is None or self.steps_done >= self.run.steps else
                  "stopped" if self.stop_checkpoint is not None else "stopped_without_checkpoint")
        return {"status": status, "stopped_by": self.stop_reason, "stop_checkpoint": self.stop_checkpoint}
