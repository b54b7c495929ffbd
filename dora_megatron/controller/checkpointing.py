"""Checkpoint files: the trainer part of a checkpoint, then the controller part (``controller.json``
and ``manifest.json``) written off the loop's critical path.

WHY a component of its own: what a checkpoint *holds* is the executor's and the orchestrator's
state (:meth:`~dora_megatron.controller.controller_state.ControllerState.state_dict`, cut in one loop turn);
how it reaches the disk (clear a stale directory, the trainer's save, the checksums of its files,
the chunked writer chained after the previous one, the completion marker last) is a job of its
own, DESIGN section 5.5.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dora_megatron.events import CheckpointSaved
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.records import RunPaths, Trainer
from dora_megatron.controller.run_tasks import RunTasks

if TYPE_CHECKING:
    from dora_megatron.controller.checkpoint_manifest import FileEntry
    from dora_megatron.observability.timeline import Timeline

log = logging.getLogger(__name__)


def _clear_stale_checkpoint(path: Path) -> None:
    """Remove an old checkpoint directory about to be rewritten: the completion marker first, so a
    crash part-way leaves an incomplete (ignored) directory, never a mix of two lineages."""
    import shutil

    (path / "controller.json").unlink(missing_ok=True)
    log.info("replacing the stale checkpoint %s", path)
    shutil.rmtree(path, ignore_errors=True)


class CheckpointWriter:
    """Writes checkpoint ``version`` under ``paths.checkpoint_dir(version)``: the ``trainer`` writes
    its part, ``events`` hears when it is done; ``tasks``: the clock, the task that waits for a
    state file; ``timeline`` (None: none)."""

    def __init__(self, paths: RunPaths, *, trainer: Trainer, events: EventQueue, tasks: RunTasks,
                 timeline: Timeline | None) -> None:
        self.trainer = trainer
        self.events = events
        self.tasks = tasks
        self.timeline = timeline
        self.paths = paths
        # checksums of the trainer part of the checkpoint being written
        self._trainer_manifest: dict[str, FileEntry] = {}
        self._thread: ThreadPoolExecutor | None = None  # writes controller.json (state_file), one at a time
        self._last: Future[None] | None = None  # the run's last checkpoint's write, waited for by close()

    def path(self, version: int) -> Path:
        """Where checkpoint ``version`` goes (:meth:`RunPaths.checkpoint_dir`)."""
        if not self.paths.checkpoints:  # the runtime saves only in a run that writes checkpoints
            raise RuntimeError(f"checkpoint v{version} asked for in a run without checkpoints (RunPaths.checkpoints "
                               "is off)")
        return Path(self.paths.checkpoint_dir(version))

    async def save_trainer(self, version: int) -> None:
        """Trainer part of checkpoint ``version`` (model + optimizer via dist_checkpointing); then
        :class:`CheckpointSaved` asks the loop for the controller part."""
        path = self.path(version)
        if path.exists():  # left by a crashed lineage after the checkpoint this run resumed from
            await asyncio.to_thread(_clear_stale_checkpoint, path)
        path.mkdir(parents=True, exist_ok=True)
        start = self.tasks.now()
        await self.trainer.save_checkpoint(str(path / "trainer"))
        from dora_megatron.controller.checkpoint_manifest import describe_tree

        # checksums of what the trainer wrote (off the event loop: real checkpoints are large)
        self._trainer_manifest = await asyncio.to_thread(describe_tree, path, "trainer")
        if self.timeline is not None:
            self.timeline.span("trainer", f"checkpoint v{version}", start, self.tasks.now(), kind="checkpoint")
        await self.events.report(CheckpointSaved(version))

    def start_state(self, version: int, state: dict[str, Any], complete: Callable[[], None]) -> Iterator[None]:
        """The writer of the controller part ``state`` (:func:`~dora_megatron.controller.state_file.write_state`),
        with the trainer files' checksums; ``complete`` runs once ``controller.json`` is in place."""
        from dora_megatron.controller.state_file import write_state

        entries, self._trainer_manifest = self._trainer_manifest, {}
        return write_state(self.path(version), state, entries, complete)

    def finish(self, version: int, writer: Iterator[None], *, last: bool) -> None:
        """Run ``writer`` after any earlier one, in the checkpoint writer's thread (its encoding is
        proportional to the tokens the state holds: not on the loop); a task of the run waits for
        it, so a failed write stops the run. ``last`` (the run's last checkpoint: the run ends
        right after and cancels its tasks): :meth:`close`, at the run's end, waits for it and
        returns its failure. Never waited for on the loop: at reasoning lengths the last state
        holds millions of tokens, and waiting for it held the loop for seconds."""
        if self._thread is None:
            # one thread: checkpoints are written in the order they were cut
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="controller-state")
        done = self._thread.submit(_drain, writer)
        if last:
            self._last = done
            return

        async def drive() -> None:
            await asyncio.wrap_future(done)

        self.tasks.spawn(drive(), f"controller-state-v{version}")

    def close(self) -> BaseException | None:
        """Wait for the state files still being written (the run is over; off the loop: the
        runtime calls this in a thread) and stop the thread. Returns the run's last checkpoint's
        failure (None: written, or none was due), for the run to end with."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        last, self._last = self._last, None
        return last.exception() if last is not None else None


def _drain(writer: Iterator[None]) -> None:
    for _ in writer:
        pass
