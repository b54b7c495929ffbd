"""TensorBoard scalars, behind a tiny interface so tests and the simulator can swap it.

Uses the ``tensorboard`` package's own event writer through torch's
``SummaryWriter`` (imported lazily); ``NullWriter`` keeps call sites branch-free
when TensorBoard is off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol


class ScalarWriter(Protocol):
    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardWriter:
    """``purge_step``: a resumed run re-does the steps from its checkpoint on; TensorBoard then
    hides the crashed lineage's scalars at steps >= ``purge_step``, so each step shows once."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(logdir), purge_step=purge_step)

    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        for tag, value in values.items():
            if value is None:
                continue
            self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalar_tags(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in ``logdir`` (for tests and reports): tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
