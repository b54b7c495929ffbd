"""Routed experts written to disk as each sample finishes, so that a step's hand-off does not
write them.

WHY: with routing replay a sample carries ``layers x top_k`` expert ids per token (384 for a
48-layer top-8 MoE): the paper's 512 x 16 step at 2.4K tokens is ~7.5 GB of them, ~50x its token
ids and log-probs. Written by :func:`~dora_megatron.comm.batch_files.write_batch` when the batch
is released, that write alone took the hand-off minutes on a shared filesystem while the trainer
waited (an eighth of that step: 8 s here, ``docs/results/controller_scale.md``). Here each finished
sample's ids are appended to a segment file of the spool directory (next to the batch directories,
on the filesystem the trainer's ranks share) by one writer thread while the rollout goes on: the
write is spread over the step's generation, and the batch entry names where each sample's ids
are (``routed_at``); each rank reads only its own samples' ids from there.

Layout: ``<batches>/routed/routed_<n>.bin``, raw little-endian ids, each sample's run in its own
dtype (the smallest that holds its ids), at the byte offset its :class:`SpooledRouted` names. A
segment file is deleted once every sample in it was trained (:meth:`RoutedSpool.release`).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

#: the spool's directory name, beside a run's batch directories (a reader finds it from the batch's ``dir``)
SPOOL_DIR = "routed"
#: a new segment file starts past this many bytes (a segment goes once all of its samples were trained)
SEGMENT_BYTES = 256 << 20
SEGMENT_NAME = re.compile(r"routed_\d{6}\.bin")
ROUTED_DTYPES = ("int8", "int16", "int32")


@dataclass(frozen=True)
class SpooledRouted:
    """Where one sample's routed experts are in the spool: ``count`` ids of ``dtype`` at byte
    ``offset`` of segment ``file`` (a bare file name in the spool directory)."""

    file: str
    offset: int
    count: int
    dtype: str

    def entry(self) -> list[str | int]:
        """The batch entry's ``routed_at`` of this sample."""
        return [self.file, self.offset, self.dtype]


class RoutedSpool:
    """Appends finished samples' routed experts to segment files in ``directory``, in one writer
    thread (:meth:`put` returns at once, on the event loop); :meth:`flush` waits for the writes
    (before a batch naming them is handed over) and raises a write's failure."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routed-spool")
        self._segment = -1
        self._offset = 0
        self._live: dict[str, int] = {}  # segment -> samples in it not yet trained
        self._last: Future[None] | None = None
        self._lock = threading.Lock()  # put (loop) and release (a worker thread) share _live
        self._fh: BinaryIO | None = None  # the writer thread's open segment
        self._fh_name = ""

    def _current(self) -> str:
        return f"routed_{self._segment:06d}.bin"

    def put(self, ids: np.ndarray) -> SpooledRouted:
        """Queue ``ids`` (a flat integer array, not changed afterwards) for the spool; returns where
        they will be."""
        ids = np.ascontiguousarray(ids)
        dtype = ids.dtype.name
        if dtype not in ROUTED_DTYPES:
            raise ValueError(f"routed_experts: {dtype} ids, not one of {ROUTED_DTYPES}")
        with self._lock:
            if self._segment < 0 or (self._offset and self._offset + ids.nbytes > self.segment_bytes):
                if self._segment >= 0 and self._current() not in self._live:  # all of it trained already
                    self._pool.submit(self._unlink, [self._current()])
                self._segment, self._offset = self._segment + 1, 0
            name = self._current()
            ref = SpooledRouted(name, self._offset, int(ids.size), dtype)
            self._offset += ids.nbytes
            self._live[name] = self._live.get(name, 0) + 1
        self._last = self._pool.submit(self._write, name, ids.astype(ids.dtype.newbyteorder("<"), copy=False))
        return ref

    def _write(self, name: str, ids: np.ndarray) -> None:
        fh = self._fh
        if fh is None or self._fh_name != name:
            if fh is not None:
                fh.close()
            self.dir.mkdir(parents=True, exist_ok=True)
            # a new segment: truncated (a stale file of an earlier process of the run is not appended to)
            fh = self._fh = open(self.dir / name, "wb")
            self._fh_name = name
        fh.write(ids.data)
        fh.flush()  # readers are other processes: the bytes must be in the file, not our buffer

    def flush(self) -> None:
        """Wait until every queued write is in its file; raises the first failed write's error
        (every write after a failure fails too: the writes are in order)."""
        last = self._last
        if last is not None:
            last.result()

    def release(self, refs: list[SpooledRouted]) -> None:
        """``refs``' samples were trained: a segment none of whose samples is left is deleted
        (blocking: call it in a worker thread)."""
        gone = []
        with self._lock:
            for r in refs:
                left = self._live.get(r.file, 0) - 1
                if left > 0:
                    self._live[r.file] = left
                    continue
                self._live.pop(r.file, None)
                if r.file != self._current():  # the open segment still takes new samples
                    gone.append(r.file)
        self._unlink(gone)

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass

    def close(self, remove: bool = True) -> None:
        """Stop the writer thread (after its queued writes); ``remove``: delete the spool."""
        self._pool.shutdown(wait=True)
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
