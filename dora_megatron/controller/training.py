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
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Protocol

from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.events import TrainerDone
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.records import RunPaths, Trainer
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


class TrainingHost(Protocol):
    """What the trainer step uses of the executor: the trainer, the samples, the queue, the clock, tasks."""

    orch: Orchestrator
    trainer: Trainer
    store: SampleStore  # the sample store: the batch hand-off (:mod:`.samples`)
    events: EventQueue
    metrics: MetricsRecorder
    timeline: Timeline | None
    evaluator: Evaluator | None
    rollout_dump: RolloutDumper | None
    moves: Migrations  # the migrations (:mod:`.migration`): the bytes moved so far, for the step's row

    def now(self) -> float: ...

    def spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[None]: ...

    def stop(self, error: BaseException | None = None) -> None: ...

    def is_done(self) -> bool: ...


class Training:
    """Carries out :class:`ReleaseBatch` actions and logs each trained step (DESIGN section 5.3);
    ``host``: the executor; ``run``: the config's section (``steps``, ``checkpoint_interval``);
    ``controller``: the config's section (``stop_checkpoint_timeout_s``); ``paths``: whether the run
    writes checkpoints (:attr:`RunPaths.checkpoints`); ``on_step(record, host)``: after each step's
    record (the launcher's outputs; the run's records are the recorder's, ``host.metrics.rows``)."""

    def __init__(self, host: TrainingHost, run: RunConfig, controller: ControllerConfig, paths: RunPaths,
                 on_step: Callable[[StepRecord, Any], None] | None = None) -> None:
        self.rt = host
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

    def idle_since(self, t: float) -> None:
        """The trainer waits for its first batch from ``t`` (the run's start, or its resume)."""
        self._trainer_idle_since = t

    def release_batch(self, a: ReleaseBatch) -> None:
        """Hand the batch to the trainer: the groups are consumed now (exactly once), ``/train`` runs
        in a task that reports :class:`TrainerDone`."""
        rt = self.rt
        start = rt.now()
        wait = max(0.0, start - self._trainer_idle_since)
        samples, batch, dumped = rt.store.take_batch(a, wait, dump=rt.rollout_dump is not None)
        if rt.rollout_dump is not None:
            rt.rollout_dump.dump(a.step, dumped)
        rt.spawn(self._train(a.step, samples, start, batch), f"train-{a.step}")

    async def _train(self, step: int, samples: list[TrainSample], start: float, batch: ReleasedBatch) -> None:
        """``batch``: what the store noted of it (:class:`~dora_megatron.controller.samples.ReleasedBatch`)."""
        rt = self.rt
        t_train = time.monotonic()
        result = await rt.trainer.train(step, samples)
        train_s = time.monotonic() - t_train
        trained = rt.now()
        # the trainer's own measures when it reports them: /train includes the snapshot export
        export_s = min(float(result.get("export_s") or 0.0), train_s)
        rt.metrics.trainer_sync(trained - export_s, trained)
        train_s = float(result.get("train_s", train_s - export_s))
        await rt.events.report(TrainerDone(step, result, start, train_s, batch))

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        """Loop (:class:`TrainerDone`): log the step; returns the new weights' version and whether a
        checkpoint is due (then its trainer part is to be written and :class:`CheckpointSaved` follows)."""
        rt, result, b = self.rt, ev.result, ev.batch
        new_version = int(result["version"])
        end = rt.now()
        metrics = dict(result.get("metrics", {}))
        if result.get("padding_fraction") is not None:  # a trainer that packs reports it beside its metrics
            metrics["padding_fraction"] = result["padding_fraction"]
        oc = rt.orch.counters
        rt.metrics.step_trained(
            ev.step, end_s=end, wait_s=b.wait_s, train_s=ev.train_s, tokens=b.tokens, staleness=b.staleness,
            rewards=b.rewards, response_lengths=b.lengths, live_versions=live_versions, metrics=metrics,
            migrations=oc.migrations, migrated_kv_bytes=rt.moves.migrated_bytes, reprefill_tokens=oc.reprefill_tokens,
            reward_errors=b.reward_errors, groups=b.group_ids, versions=b.versions)
        record = rt.metrics.rows[-1]
        # the orchestrator numbers steps from 0 (its step counter, restored with it on resume):
        # trained step ``ev.step`` makes ``ev.step + 1`` steps done
        self.steps_done = ev.step + 1
        if rt.timeline is not None:
            rt.timeline.span("trainer", f"step {ev.step}", ev.start, end, version=ev.step, kind="train",
                             produced=new_version)
        if self.on_step is not None:
            self.on_step(record, rt)
        self._trainer_idle_since = end
        finished = self.steps_done >= self.run.steps
        last = finished or self.stop_reason is not None  # a stop ends the run here
        if rt.evaluator is not None:  # a round of these weights, beside the rollout (or the final one)
            rt.evaluator.after_step(self.steps_done, new_version, finished)
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
            self.rt.stop()
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
        if self.stop_reason is not None or self.rt.is_done():
            return
        self.stop_reason = reason
        timeout = self.controller.stop_checkpoint_timeout_s
        log.warning("stop asked (%s): checkpoint at the end of the current step (at most %.0f s, "
                    "controller.stop_checkpoint_timeout_s), then exit", reason, timeout)
        self.rt.spawn(self._abandon_after(timeout), "stop-timeout")

    async def _abandon_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if not self._stop_at_boundary and not self.rt.is_done():
            log.warning("stop (%s): no step boundary within %.0f s (controller.stop_checkpoint_timeout_s): the "
                        "step is abandoned; the last complete checkpoint stays", self.stop_reason, timeout_s)
            self.rt.stop()

    def status(self) -> dict[str, Any]:
        """The summary's end of the run: ``status`` is "completed"; "stopped" (a stop request:
        checkpoint ``stop_checkpoint`` written, ``--resume`` goes on from it); or
        "stopped_without_checkpoint" (the step was abandoned: the last complete checkpoint stays)."""
        status = ("completed" if self.stop_reason is None or self.steps_done >= self.run.steps else
                  "stopped" if self.stop_checkpoint is not None else "stopped_without_checkpoint")
        return {"status": status, "stopped_by": self.stop_reason, "stop_checkpoint": self.stop_checkpoint}
