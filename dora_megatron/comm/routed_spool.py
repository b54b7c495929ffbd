"""Routed experts written to disk as each sample finishes, so that a step's hand-off does not
write them.

WHY: with routing replay a sample carries ``layers x top_k`` expert ids per token (384 for a
48-layer top-8 MoE): the paper's 512 x 16 step at 2.4K tokens is ~7.5 GB of them, ~50x its token
ids and log-probs. Written by :func:`~dora_megatron.comm.batch_files.write_batch` when the batch
is released, that write alone took the hand-off minutes on a shared filesystem while the trainer
waited (an eighth of that step took seconds on this project's test machine). Here each finished
sample's ids are appended to a segment file of the spool directory (next to the batch directories,
on the filesystem the trainer's ranks share) by one writer thread while the rollout goes on: the
write is spread over the step's generation, and the batch entry names where each sample's ids
are (``routed_at``); each rank reads only its own samples' ids from there.

Layout: ``<batches>/routed/routed_<n>.bin``, raw little-endian ids, each sample's run in its own
dtype (the smallest that holds its ids), at the byte offset its :class:`SpooledRouted` names.

The controller holds only that location: a checkpoint's and the journal's sample entries record it
(``routed_at``) instead of the ids, and a ``--resume`` reads them back from the spool, so a segment
stays until no checkpoint a resume may load names any sample in it (:class:`RoutedSpool`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

log = logging.getLogger(__name__)

#: the spool's directory name, beside a run's batch directories (a reader finds it from the batch's ``dir``)
SPOOL_DIR = "routed"
#: a new segment file starts past this many bytes (a segment goes once all of its samples were trained)
SEGMENT_BYTES = 256 << 20
SEGMENT_NAME = re.compile(r"routed_\d{6}\.bin")
ROUTED_DTYPES = ("int8", "int16", "int32")


class SpoolError(RuntimeError):
    """A sample's spooled routed experts cannot be read back (resume: a segment missing or short)."""


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

    @property
    def end(self) -> int:
        """The byte just past this sample's ids in its segment."""
        return self.offset + self.count * np.dtype(self.dtype).itemsize

    def state(self) -> list[str | int]:
        """What a checkpoint's or the journal's sample entry records (``routed_at``), instead of the ids."""
        return [self.file, self.offset, self.count, self.dtype]

    @classmethod
    def from_state(cls, value: Any, where: str) -> SpooledRouted:
        """:meth:`state` read back; ``where`` names the entry in the refusal of a malformed one."""
        ok = (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
              and SEGMENT_NAME.fullmatch(value[0]) is not None and all(isinstance(v, int) for v in value[1:3])
              and value[1] >= 0 and value[2] >= 0 and value[3] in ROUTED_DTYPES)
        if not ok:
            raise SpoolError(f"{where}: routed_at must be [routed_NNNNNN.bin, offset >= 0, count >= 0, one of "
                             f"{ROUTED_DTYPES}], got {value!r}")
        return cls(value[0], value[1], value[2], value[3])


class RoutedSpool:
    """Appends finished samples' routed experts to segment files in ``directory``, in one writer
    thread (:meth:`put` returns at once, on the event loop); :meth:`flush` waits for the writes
    (before a batch or a checkpoint naming them is handed over) and raises a write's failure.

    WHY it owns when a segment goes: the samples of a segment leave the controller at different
    times (trained in different steps, or dropped), and a checkpoint or the journal that a resume
    may load still names them after that. Per segment it counts the samples the controller holds
    (:meth:`put`, :meth:`adopt` on resume; :meth:`retire` when trained or dropped) and remembers
    the latest checkpoint cut a retired sample was still held at; a segment is deleted once it holds
    no held sample and every checkpoint a resume may load was cut after its last retirement. Those
    are the journal's (:mod:`~dora_megatron.controller.journal`): the newest complete checkpoint,
    the complete one before it (the fallback of a corrupt newest) and any being written; a
    checkpoint cut after a sample was trained names it neither in its state nor in its journal tail.
    No checkpoint yet: a retired sample's segment can go at once. Segment numbers go on from the
    files already there, so a resumed run never overwrites a segment its checkpoint names."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routed-spool")
        self._segment = max((int(p.name[7:13]) for p in self._files()), default=-1)  # the last one on disk
        self._open = False  # this process writes a segment of its own (the next number) from its first put
        self._offset = 0
        self._live: dict[str, int] = {}  # segment -> samples of it the controller holds
        self._retired: dict[str, int] = {}  # segment -> the cut count when a sample of it was last retired
        self._cuts = 0  # checkpoint cuts so far in this process (a resume's loaded checkpoint is cut 0)
        self._cut_of: dict[int, int] = {}  # checkpoint version -> its cut, while it is being written
        self._complete: list[int] = []  # the cuts of the two newest complete checkpoints
        self._last: Future[None] | None = None
        self._error: BaseException | None = None  # the first failed write (every later one is skipped)
        self._lock = threading.Lock()  # the loop, the trainer client's and the checkpoint's threads share the counts
        self._submitting = threading.Lock()
        self._closed = False  # the writer thread is stopped (:meth:`close`)
        self._fh: BinaryIO | None = None  # the writer thread's open segment
        self._fh_name = ""

    def _files(self) -> list[Path]:
        return [p for p in self.dir.glob("routed_*.bin") if SEGMENT_NAME.fullmatch(p.name)]

    def _current(self) -> str:
        return f"routed_{self._segment:06d}.bin"

    def put(self, ids: np.ndarray) -> SpooledRouted:
        """Queue ``ids`` (a flat integer array, not changed afterwards) for the spool; returns where
        they will be. The sample is held until :meth:`retire`."""
        ids = np.ascontiguousarray(ids)
        dtype = ids.dtype.name
        if dtype not in ROUTED_DTYPES:
            raise ValueError(f"routed_experts: {dtype} ids, not one of {ROUTED_DTYPES}")
        with self._lock:
            if not self._open or (self._offset and self._offset + ids.nbytes > self.segment_bytes):
                was, self._open = self._current() if self._open else None, True
                self._segment, self._offset = self._segment + 1, 0
                if was is not None and self._free(was):  # all of it retired already
                    self._submit(self._unlink, [was])
            name = self._current()
            ref = SpooledRouted(name, self._offset, int(ids.size), dtype)
            self._offset += ids.nbytes
            self._live[name] = self._live.get(name, 0) + 1
        self._submit(self._write, name, ids.astype(ids.dtype.newbyteorder("<"), copy=False))
        return ref

    def _submit(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on the writer thread after everything queued before (a deletion after the
        writes of its segment)."""
        with self._submitting:  # ``_last`` is the last job queued, whichever thread queued it
            if self._closed:  # a late deletion (a checkpoint completing as the run ends): done here
                fn(*args)
                return
            self._last = self._pool.submit(fn, *args)

    def _write(self, name: str, ids: np.ndarray) -> None:
        if self._error is not None:
            return  # in order: nothing after a failed write
        try:
            fh = self._fh
            if fh is None or self._fh_name != name:
                if fh is not None:
                    fh.close()
                self.dir.mkdir(parents=True, exist_ok=True)
                # a new segment (its number is past every file there): created, never appended to
                fh = self._fh = open(self.dir / name, "wb")
                self._fh_name = name
            fh.write(ids.data)
            fh.flush()  # readers are other processes: the bytes must be in the file, not our buffer
        except BaseException as err:
            self._error = err
            raise

    def flush(self) -> None:
        """Wait until every queued write is in its file; raises the first failed write's error
        (every write after a failure is skipped: the writes are in order)."""
        last = self._last
        if last is not None:
            try:
                last.result()
            except BaseException:
                pass  # raised below when it was a write's
        if self._error is not None:
            raise self._error

    # ---- what the controller holds, and what a resume may need -------------------------------
    def retire(self, refs: Iterable[SpooledRouted]) -> None:
        """``refs``' samples left the controller (trained, or dropped untrained): their segments go
        once no checkpoint a resume may load can name them (the class's rule)."""
        with self._lock:
            touched = set()
            for r in refs:
                left = self._live.get(r.file, 0) - 1
                if left > 0:
                    self._live[r.file] = left
                else:
                    self._live.pop(r.file, None)
                self._retired[r.file] = self._cuts
                touched.add(r.file)
            gone = [f for f in sorted(touched) if self._free(f)]
        if gone:
            self._submit(self._unlink, gone)

    def checkpoint_cut(self, version: int) -> None:
        """Checkpoint ``version``'s state was cut (loop): a sample retired from now on is not in it."""
        with self._lock:
            self._cuts += 1
            self._cut_of[int(version)] = self._cuts

    def checkpoint_completed(self, version: int) -> None:
        """Checkpoint ``version`` is complete (any thread): the one before the previous complete one
        is no longer loaded by a resume, so what only it named goes."""
        with self._lock:
            cut = self._cut_of.pop(int(version), None)
            if cut is None:
                return
            self._complete = [*self._complete, cut][-2:]
            gone = [f for f in sorted(self._retired) if self._free(f)]
        if gone:
            self._submit(self._unlink, gone)

    def adopt(self, ref: SpooledRouted) -> str | None:
        """Resume: a sample of the loaded checkpoint (or its journal tail) is held again. Returns why
        its ids cannot be read back (its segment missing or short; it is then not held), None when
        they can."""
        path = self.dir / ref.file
        try:
            size = path.stat().st_size
        except OSError as err:
            return f"{path} is missing ({err.strerror})"
        if size < ref.end:
            return f"{path} has {size} bytes, its {ref.count} {ref.dtype} ids end at byte {ref.end}"
        with self._lock:
            self._live[ref.file] = self._live.get(ref.file, 0) + 1
        return None

    def resumed(self) -> None:
        """Resume, after every :meth:`adopt`: the loaded checkpoint is the one a later resume falls
        back to, and a segment no adopted sample is in goes (the crashed lineage's, or one only an
        older checkpoint named: the journal too starts anew from the loaded one)."""
        with self._lock:
            self._complete, self._cuts = [0], 0
            gone = [p.name for p in self._files() if p.name not in self._live]
        self._unlink(gone)

    def _free(self, name: str) -> bool:
        """Whether segment ``name`` can go (under the lock): no sample of it held, none named by a
        checkpoint a resume may load, and not the one being appended to."""
        if self._live.get(name, 0) > 0 or (self._open and name == self._current()):
            return False
        pending = list(self._cut_of.values())
        candidates = [*self._complete[:1], *pending] if self._complete or pending else []
        if candidates and self._retired.get(name, -1) >= min(candidates):
            return False
        self._retired.pop(name, None)
        return True

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass
            except OSError as err:  # the run goes on: a segment left over costs disk, not correctness
                log.warning("routed spool: could not delete %s: %s", self.dir / name, err)

    def close(self) -> None:
        """The run is over: stop the writer thread (after its queued writes); the samples still held
        are dropped, and only the segments a checkpoint a resume may load names stay (all of them go
        without checkpoints: the spool's directory too)."""
        with self._submitting:
            self._closed = True
        self._pool.shutdown(wait=True)
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        with self._lock:
            for name in list(self._live):
                self._retired[name] = self._cuts
            self._live.clear()
            self._open = False
            gone = [p.name for p in self._files() if self._free(p.name)]
        self._unlink(gone)
        try:
            self.dir.rmdir()  # only when empty
        except OSError:
            pass
