"""A released training batch as columnar files: the controller writes them once, each trainer
data-parallel rank reads only the samples it trains.

WHY files and not the ``/train`` body: at reasoning lengths a step is millions of tokens (the
paper's 512 x 16 at 2.4K is ~20M, ~9 billion routed-expert ids with R3 on a 48-layer top-8 MoE).
As a JSON body that is ~0.6 GB (without R3) encoded on the controller's event loop for seconds,
decoded by the trainer's rank 0 for seconds more, then pickled to every rank, so every rank paid
for the whole step. Here the body carries only a few numbers per sample (its lengths, reward, group,
version); the tokens, log-probs, loss masks and routed experts are flat ``.npy`` arrays in a
directory of the run (SLURM jobs share the run directory's filesystem), written in a worker thread
with bulk copies (numpy releases the GIL for them), and every rank maps them (``mmap_mode="r"``) and
copies out only the rows its data-parallel share trains: bytes per rank ~ total / DP. What the
trainer plans (packing, which rank trains which sample) stays in the trainer: a rank picks its rows
from the lengths in the request, with the same plan it trains with.

Layout of a batch directory (all arrays little-endian, concatenated in sample order):

``prompt_ids.npy``        int32, every sample's prompt tokens
``response_ids.npy``      int32, every sample's response tokens
``rollout_logprobs.npy``  float32, one per response token
``loss_mask.npy``         uint8, one per response token (only when some sample has a mask; 1 elsewhere)
``routed_experts.npy``    the engine's flat routed-expert ids ``(positions, layers, top_k)`` per
                          sample, in the smallest signed integer type that holds the batch's expert
                          ids (:func:`expert_dtype`; -1 marks unrouted slots), only when samples carry them
                          and were not spooled (below)

A sample's routed experts already written to the run's spool while it finished
(:mod:`~dora_megatron.comm.routed_spool`, ``<dir>/../routed/``) are not copied: its entry's
``routed_at`` is ``[segment file name, byte offset, dtype]`` and the rank that trains it reads its
``routed_ids`` ids from there.

The request's ``batch`` entry: ``{"dir": path, "samples": [{"prompt_tokens", "response_tokens",
"routed_ids", "routed_at"?, "reward", "group_id", "version", "advantage"?, "loss_mask"?}, ...]}``,
decoded by msgspec into a :class:`~dora_megatron.comm.train_sample.BatchEntry` (:func:`decode_batch`,
or with the whole body by :func:`~dora_megatron.comm.train_sample.decode_train`): the field types
refuse a malformed entry naming the field and sample, and :class:`BatchReader` reads typed fields.
The columns and the entry's fields are those of :class:`~dora_megatron.comm.train_sample.TrainSample`:
the controller writes its samples, a rank reads back the same record.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from dora_megatron.comm.protocol import field_message
from dora_megatron.comm.routed_spool import SPOOL_DIR, SpooledRouted
from dora_megatron.comm.train_sample import BatchEntry, TrainSample

#: the per-token arrays of a batch directory and their dtypes (routed experts: :func:`expert_dtype`)
TOKEN_FILES = {"prompt_ids": np.int32, "response_ids": np.int32, "rollout_logprobs": np.float32}
OPTIONAL_FILES = ("loss_mask", "routed_experts")
#: sample fields of the request besides the lengths (the trainer's advantages need them for every sample)
SCALAR_FIELDS = ("reward", "group_id", "version", "advantage")


class BatchFileError(ValueError):
    """A batch entry or directory that does not match what it says; names the field at fault."""


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer type that holds expert ids ``0 .. num_experts - 1`` and the
    ``-1`` of an unrouted slot (int8 up to 127 experts, int16 up to 32,767, else int32)."""
    for dt in (np.int8, np.int16, np.int32):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise BatchFileError(f"routed_experts: {num_experts} experts do not fit an int32 id")


def routed_array(routed: Any) -> np.ndarray:
    """A sample's routed experts as a flat integer array: SGLang's base64 of int32 bytes, a nested
    list, or an array already."""
    if isinstance(routed, str):
        try:
            raw = base64.b64decode(routed.encode("ascii"), validate=True)
        except ValueError as err:
            raise BatchFileError(f"routed_experts is not base64: {err}") from None
        if len(raw) % 4:
            raise BatchFileError(f"routed_experts has {len(raw)} bytes, not a whole number of int32 ids")
        return np.frombuffer(raw, dtype="<i4")
    return np.asarray(routed).reshape(-1)


#: ``array.array`` type codes already in a column's dtype (little-endian hosts): written as they are
_SAME_CODES: dict[np.dtype[Any], str] = {np.dtype(np.int32): "i", np.dtype(np.float32): "f"}


def _flat(value: Any, dtype: npt.DTypeLike, where: str) -> np.ndarray | array[Any]:
    """``value`` (a list, an ``array.array`` or a numpy array) as a 1-D array of ``dtype`` (no copy
    when it already is one); token ids and masks must be integers, log-probs numbers. An
    ``array.array`` of the column's type (how the controller's sample store holds ids and
    log-probs) is returned as it is: wrapping each of 8,192 samples in numpy cost more than
    writing them."""
    if isinstance(value, array) and value.itemsize == 4 and _SAME_CODES.get(np.dtype(dtype)) == value.typecode \
            and sys.byteorder == "little":
        return value
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BatchFileError(f"{where} must be a flat sequence, got shape {arr.shape}")
    kinds = "iuf" if np.dtype(dtype).kind == "f" else "iub"
    if arr.size and arr.dtype.kind not in kinds:
        raise BatchFileError(f"{where} holds {arr.dtype} values, not {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False)


def _save(path: Path, parts: Sequence[np.ndarray | array[Any]], dtype: npt.DTypeLike) -> None:
    """The ``.npy`` of ``parts`` concatenated, written part by part (no copy of the whole column in
    memory; the file writes release the GIL)."""
    dt = np.dtype(dtype)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dt),
                                                 "fortran_order": False, "shape": (sum(len(p) for p in parts),)})
        for p in parts:
            f.write(p if isinstance(p, array) else np.ascontiguousarray(p, dtype=dt).data)


def write_batch(directory: Path, samples: Sequence[TrainSample]) -> dict[str, Any]:
    """Write ``samples`` as a batch directory; returns the request's
    ``batch`` entry. Written to ``<directory>.tmp`` and renamed: a reader never sees half a batch.
    Blocking: call it in a worker thread."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)  # a retried step's earlier files
    tmp.mkdir(parents=True)
    cols: dict[str, list[np.ndarray | array[Any]]] = {k: [] for k in (*TOKEN_FILES, "loss_mask")}
    routed_parts: list[np.ndarray] = []
    spooled = 0
    meta: list[dict[str, Any]] = []
    any_mask = any(s.loss_mask is not None for s in samples)
    for i, s in enumerate(samples):
        prompt = _flat(s.prompt_ids, np.int32, f"samples[{i}].prompt_ids")
        response = _flat(s.response_ids, np.int32, f"samples[{i}].response_ids")
        logprobs = _flat(s.rollout_logprobs, np.float32, f"samples[{i}].rollout_logprobs")
        if len(logprobs) != len(response):
            raise BatchFileError(f"samples[{i}]: rollout_logprobs ({len(logprobs)}) and response_ids "
                                 f"({len(response)}) differ in length")
        cols["prompt_ids"].append(prompt)
        cols["response_ids"].append(response)
        cols["rollout_logprobs"].append(logprobs)
        entry: dict[str, Any] = {"prompt_tokens": len(prompt), "response_tokens": len(response)}
        if any_mask:
            mask = s.loss_mask
            cols["loss_mask"].append(np.ones(len(response), np.uint8) if mask is None
                                     else _flat(mask, np.uint8, f"samples[{i}].loss_mask"))
            entry["loss_mask"] = mask is not None
        routed = s.routed_experts
        if isinstance(routed, SpooledRouted):  # in the spool already: named, not copied
            spooled += 1
            entry["routed_ids"], entry["routed_at"] = routed.count, routed.entry()
        elif routed is not None:
            ids = routed_array(routed)
            routed_parts.append(ids)
            entry["routed_ids"] = int(ids.size)
        for k in SCALAR_FIELDS:
            if getattr(s, k) is not None:
                entry[k] = getattr(s, k)
        meta.append(entry)
    if (routed_parts or spooled) and len(routed_parts) + spooled != len(samples):
        raise BatchFileError("routed_experts: some samples of the batch carry them and some do not")
    files: list[tuple[str, Sequence[np.ndarray | array[Any]], npt.DTypeLike]] = [
        (name, cols[name], dtype) for name, dtype in TOKEN_FILES.items()]
    if any_mask:
        files.append(("loss_mask", cols["loss_mask"], np.uint8))
    if routed_parts:
        top = max((int(p.max()) for p in routed_parts if p.size), default=0)
        files.append(("routed_experts", routed_parts, expert_dtype(top + 1)))
    # the columns at once, a thread each: the writes (and numpy's casts) release the GIL, so the
    # files fill in parallel where the filesystem allows
    with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="batch-files") as pool:
        for done in [pool.submit(_save, tmp / f"{name}.npy", parts, dtype) for name, parts, dtype in files]:
            done.result()
    os.replace(tmp, directory)
    return {"dir": str(directory), "samples": meta}


def decode_batch(entry: Any) -> BatchEntry:
    """A ``/train`` body's ``batch`` (parsed JSON) as a :class:`BatchEntry`, its fields checked by
    msgspec against their types in one pass (a few ms for an 8,192-sample step); a
    :class:`BatchFileError` names the field, the sample and the value at fault
    (``batch.samples[3].prompt_tokens must be >= 0, got -1``). A whole ``/train`` body decodes its
    entry the same way (:func:`~dora_megatron.comm.train_sample.decode_train`)."""
    try:
        return msgspec.convert(entry, BatchEntry, strict=True)
    except msgspec.ValidationError as err:
        raise BatchFileError(field_message(err, entry, path="batch")) from None


class BatchReader:
    """A batch directory opened for one rank: the files are mapped, nothing is read until
    :meth:`samples` copies out a rank's rows. ``bytes_read`` counts what was copied."""

    def __init__(self, entry: BatchEntry) -> None:
        self.dir = Path(entry.dir)
        self.meta = entry.samples
        self.entry = entry
        self.bytes_read = 0
        counts: dict[str, list[int]] = {"prompt_ids": [s.prompt_tokens for s in self.meta],
                                        "response_ids": [s.response_tokens for s in self.meta],
                                        "routed_experts": [s.routed_ids for s in self.meta if s.routed_ids is not None]}
        counts["rollout_logprobs"] = counts["response_ids"]
        self.arrays: dict[str, np.ndarray] = {}
        self.offsets: dict[str, np.ndarray] = {}
        #: sample -> its routed experts mapped from the spool (not read until :meth:`samples`)
        self.spooled: dict[int, np.ndarray] = self._spooled(counts["routed_experts"]) if counts["routed_experts"] else {}
        if self.spooled:  # routed_experts.npy holds the others' only
            counts["routed_experts"] = [0 if i in self.spooled else c for i, c in enumerate(counts["routed_experts"])]
        in_file = counts["routed_experts"] and len(self.spooled) < len(self.meta)
        names = [*TOKEN_FILES, *(["routed_experts"] if in_file else []),
                 *(["loss_mask"] if any(s.loss_mask is not None for s in self.meta) else [])]
        counts["loss_mask"] = counts["response_ids"]
        for name in names:
            path = self.dir / f"{name}.npy"
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as err:
                raise BatchFileError(f"batch.dir {self.dir}: cannot read {name}.npy: {err}") from None
            want = sum(counts[name])
            if arr.ndim != 1 or arr.shape[0] != want:
                raise BatchFileError(f"batch.dir {self.dir}: {name}.npy holds {arr.shape} values, batch.samples "
                                     f"add up to {want}")
            self.arrays[name] = arr.view(np.ndarray)  # still the mapping; plain views slice ~20x faster
            self.offsets[name] = np.concatenate([[0], np.cumsum(counts[name], dtype=np.int64)]).tolist()

    def _spooled(self, counts: list[int]) -> dict[int, np.ndarray]:
        """The samples whose entry names their routed experts in the spool (``routed_at``: a segment
        file name of the spool beside the batch directory, an offset and dtype, checked by their
        types), each checked to lie inside that file (its ``routed_ids`` ids) and mapped."""
        out: dict[int, np.ndarray] = {}
        segments: dict[str, np.ndarray] = {}
        for i, s in enumerate(self.meta):
            at = s.routed_at
            if at is None:
                continue
            where = f"batch.samples[{i}].routed_at"
            if at[0] not in segments:
                path = self.dir.parent / SPOOL_DIR / at[0]
                try:
                    segments[at[0]] = (np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
                                       if path.stat().st_size else np.zeros(0, np.uint8))
                except (OSError, ValueError) as err:
                    raise BatchFileError(f"{where}: cannot read the spool segment {path}: {err}") from None
            dt = np.dtype(at[2]).newbyteorder("<")
            end = at[1] + counts[i] * dt.itemsize
            seg = segments[at[0]]
            if end > seg.size:
                raise BatchFileError(f"{where}: {counts[i]} {at[2]} ids at byte {at[1]} end past the {seg.size} bytes "
                                     f"of {at[0]}")
            out[i] = seg[at[1]:end].view(dt)
        return out

    def __len__(self) -> int:
        return len(self.meta)

    def lengths(self) -> list[int]:
        """Each sample's prompt + response tokens (what the trainer plans a step by)."""
        return self.entry.lengths()

    def samples(self, rows: Sequence[int] | set[int]) -> list[TrainSample]:
        """Every sample of the batch, in order; the arrays of ``rows`` (this rank's share) are read
        into memory, the others stay unread views with the right lengths (the trainer takes only
        their lengths). WHY column by column:
        an 8,192-sample step, built field by field per sample, cost a rank 0.1-0.2 s of Python."""
        n = len(self.meta)
        own = {i for i in rows if 0 <= i < n}
        cols: dict[str, list[Any]] = {}
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "routed_experts", "loss_mask"):
            arr = self.arrays.get(name)
            spooled = self.spooled if name == "routed_experts" else {}
            if arr is None and not spooled:
                cols[name] = [None] * n
                continue
            off = self.offsets.get(name)
            views = [spooled[i] if i in spooled else arr[off[i]:off[i + 1]] for i in range(n)]  # type: ignore[index]
            for i in own:
                if name == "loss_mask" and not self.meta[i].loss_mask:
                    continue  # no mask of its own: never read
                views[i] = np.array(views[i])  # the read: this rank's own copy
                self.bytes_read += views[i].nbytes
            cols[name] = views
        masks = cols["loss_mask"]
        return [TrainSample(prompt_ids=p, response_ids=r, rollout_logprobs=lp, reward=s.reward,
                            group_id=s.group_id, version=s.version, advantage=s.advantage,
                            loss_mask=masks[i] if s.loss_mask else None, routed_experts=re)
                for i, (s, p, r, lp, re) in enumerate(zip(self.meta, cols["prompt_ids"], cols["response_ids"],
                                                           cols["rollout_logprobs"], cols["routed_experts"]))]


def compact_routed(routed: Any) -> np.ndarray | None:
    """A sample's routed experts as the controller keeps them: a flat array of the smallest integer
    type that holds its ids (int8 for up to 127 experts: 1 byte per id against 5.3 for SGLang's
    base64 of int32). None stays None."""
    if routed is None:
        return None
    if isinstance(routed, np.ndarray) and routed.ndim == 1 and routed.dtype in (np.int8, np.int16):
        return routed  # already compact (decoded off the loop by comm.generate_codec)
    ids = routed_array(routed)
    top = int(ids.max()) if ids.size else 0
    return ids.astype(expert_dtype(top + 1), copy=False)


#: routed expert ids encoded per base64 call by :func:`routed_base64` (a multiple of 3 bytes of
#: int32, so the slices' texts concatenate): a few ms each, the GIL free between two
B64_IDS = 3 << 18


def routed_base64(routed: Any) -> Iterator[bytes]:
    """:func:`~dora_megatron.comm.train_sample.routed_text` of a sample's routed experts as ASCII pieces, a bounded slice of ids per
    piece (for a writer thread: no single call holds the GIL for the whole, often tens of MB)."""
    if isinstance(routed, str):
        yield routed.encode("ascii")
        return
    ids = np.asarray(routed).reshape(-1)
    for i in range(0, ids.size, B64_IDS):
        yield base64.b64encode(ids[i:i + B64_IDS].astype("<i4").tobytes())
