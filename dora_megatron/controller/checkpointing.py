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
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from dora_megatron.controller.loop import CheckpointSaved, EventQueue
from dora_megatron.controller.records import RuntimeOptions, Trainer

log = logging.getLogger(__name__)


def _clear_stale_checkpoint(path: Path) -> None:
    """Remove an old checkpoint directory about to be rewritten: the completion marker first, so a
    crash part-way leaves an incomplete (ignored) directory, never a mix of two lineages."""
    import shutil

    (path / "controller.json").unlink(missing_ok=True)
    log.info("replacing the stale checkpoint %s", path)
    shutil.rmtree(path, ignore_errors=True)


class CheckpointHost(Protocol):
    """What the checkpoint writer uses of the executor that owns it."""

    events: EventQueue
    opt: RuntimeOptions
    trainer: Trainer
    timeline: Any

    def now(self) -> float: ...

    def spawn(self, coro, name: str) -> asyncio.Task: ...


class CheckpointWriter:
    """Writes checkpoint ``version`` under ``opt.checkpoint_dir(version)``; ``host``: the executor."""

    def __init__(self, host: CheckpointHost) -> None:
        self.rt = host
        self._trainer_manifest: dict[str, dict] = {}  # checksums of the trainer part of the checkpoint being written
        self._state_writer: Iterator[None] | None = None  # the controller.json writer still running (state_file)

    async def save_trainer(self, version: int) -> None:
        """Trainer part of checkpoint ``version`` (model + optimizer via dist_checkpointing); then
        :class:`CheckpointSaved` asks the loop for the controller part."""
        path = Path(self.rt.opt.checkpoint_dir(version))
        if path.exists():  # left by a crashed lineage after the checkpoint this run resumed from
            await asyncio.to_thread(_clear_stale_checkpoint, path)
        path.mkdir(parents=True, exist_ok=True)
        start = self.rt.now()
        await self.rt.trainer.save_checkpoint(str(path / "trainer"))
        from dora_megatron.controller.checkpoint_manifest import describe_tree

        # checksums of what the trainer wrote (off the event loop: real checkpoints are large)
        self._trainer_manifest = await asyncio.to_thread(describe_tree, path, "trainer")
        if self.rt.timeline is not None:
            self.rt.timeline.span("trainer", f"checkpoint v{version}", start, self.rt.now(), kind="checkpoint")
        await self.rt.events.report(CheckpointSaved(version))

    def start_state(self, version: int, state: dict[str, Any], complete: Callable[[], None]) -> Iterator[None]:
        """The writer of the controller part ``state`` (:func:`~dora_megatron.controller.state_file.write_state`),
        with the trainer files' checksums; ``complete`` runs once ``controller.json`` is in place."""
        from dora_megatron.controller.state_file import write_state

        entries, self._trainer_manifest = self._trainer_manifest, {}
        return write_state(Path(self.rt.opt.checkpoint_dir(version)), state, entries, complete)

    def finish(self, version: int, writer: Iterator[None], *, at_once: bool) -> None:
        """Run ``writer`` after any earlier one: ``at_once`` (the run's last checkpoint: the run ends
        right after and stops its tasks) here, else a chunk per loop turn in a task."""
        if at_once:
            for pending in (self._state_writer, writer):
                for _ in pending or ():
                    pass
            self._state_writer = None
            return
        prev = self._state_writer
        self._state_writer = writer

        async def drive() -> None:
            for w in (prev, writer):
                for _ in w or ():
                    await asyncio.sleep(0)

        self.rt.spawn(drive(), f"controller-state-v{version}")
