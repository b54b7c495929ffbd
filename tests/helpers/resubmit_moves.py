"""The pieces of the runtime tests on real engines without a KV export (vLLM, the SGLang stand-in),
whose migrations are abort + resubmit: a trainer that holds its steps until the move under test
has happened, and an event queue that notes each move and what it carried.

WHY these tests hold on an observed event: a move decided while a request is about to finish
moves nothing (the request finishes before the abort reaches it), and on a loaded machine the run
can end before any move lands. The tests' configurations make a move certain (version 0 is
consolidated onto one instance when step 0 ends, its long answers mid-decode), and the trainer
waits until such a move's request has finished, so the comparison with an uninterrupted greedy
answer covers it."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from dora_megatron.events import MigrationDone
from dora_megatron.controller.loop import EventQueue


class StaticTrainer:
    """A new version label per step, weights unchanged (every snapshot is the same directory).
    While ``until()`` does not hold, each step from ``first`` on waits for it (all of them together
    at most ``hold_bound_s``), so the event under test happens before the run ends, however loaded
    the machine. ``until`` None: no step waits."""

    def __init__(self, until: Callable[[], bool] | None = None, first: int = 0, hold_bound_s: float = 180.0) -> None:
        self.batches: list[list[dict]] = []
        self.until, self.first, self.hold_bound_s = until, first, hold_bound_s
        self.deadline: float | None = None

    async def train(self, step: int, samples: list[dict]) -> dict:
        if self.until is not None and step >= self.first:
            if self.deadline is None:
                self.deadline = time.monotonic() + self.hold_bound_s
            while not self.until() and time.monotonic() < self.deadline:
                await asyncio.sleep(0.01)
        self.batches.append(samples)
        return {"version": step + 1, "metrics": {}, "checksum": None}

    async def save_checkpoint(self, path: str) -> dict:
        return {"path": path}


class MoveLog(EventQueue):
    """The runtime's event queue, noting each abort + resubmit move: the sample and how many output
    tokens it carried (re-prefill minus the prompt), read from the sample's record as it is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict = {}  # the runtime's sample records, once it exists
        self.moves: list[tuple[str, int]] = []  # (sample id, output tokens carried)

    async def report(self, event) -> None:
        if isinstance(event, MigrationDone):
            prompt = self.records[event.sample_id].prompt_ids
            self.moves.append((event.sample_id, event.reprefill_tokens - len(prompt)))
        await super().report(event)

    def carried_and_ended(self) -> list[str]:
        """Samples moved with output that have finished since (consumed by the trainer, or done)."""
        return [sid for sid, carried in self.moves
                if carried > 0 and (sid not in self.records or self.records[sid].finished)]

    def to_compare(self, batches: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
        """``(prompt_ids, response_ids)`` of every trained sample (``batches``: the trainer's) and of
        each sample moved with output that finished but was not trained: what the tests set against
        an uninterrupted greedy answer."""
        out = [(list(s.prompt_ids), list(s.response_ids)) for batch in batches for s in batch]
        return out + [(list(self.records[sid].prompt_ids), list(self.records[sid].response_ids))  # compact arrays
                      for sid in self.carried_and_ended() if sid in self.records]
