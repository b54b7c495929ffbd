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

The request's ``batch`` entry: ``{"dir": path, "samples": [{"prompt_tokens", "response_tokens",
"routed_ids", "reward", "group_id", "version", "advantage"?, "loss_mask"?}, ...]}``.
"""

from __future__ import annotations

import base64
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

#: the per-token arrays of a batch directory and their dtypes (routed experts: :func:`expert_dtype`)
TOKEN_FILES = {"prompt_ids": np.int32, "response_ids": np.int32, "rollout_logprobs": np.float32}
OPTIONAL_FILES = ("loss_mask", "routed_experts")
#: sample fields of the request besides the lengths (the trainer's advantages need them for every sample)
SCALAR_FIELDS = ("reward", "group_id", "version", "advantage")
KNOWN_FIELDS = frozenset({*TOKEN_FILES, *OPTIONAL_FILES, *SCALAR_FIELDS})


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


def _flat(value: Any, dtype: Any, where: str) -> np.ndarray:
    """``value`` (a list, an ``array.array`` or a numpy array) as a 1-D array of ``dtype`` (no copy
    when it already is one); token ids and masks must be integers, log-probs numbers."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BatchFileError(f"{where} must be a flat sequence, got shape {arr.shape}")
    kinds = "iuf" if np.dtype(dtype).kind == "f" else "iub"
    if arr.size and arr.dtype.kind not in kinds:
        raise BatchFileError(f"{where} holds {arr.dtype} values, not {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False)


def _save(path: Path, parts: Sequence[np.ndarray], dtype: Any) -> None:
    """The ``.npy`` of ``parts`` concatenated, written part by part (no copy of the whole column in
    memory; the file writes release the GIL)."""
    dtype = np.dtype(dtype)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                 "fortran_order": False, "shape": (sum(p.size for p in parts),)})
        for p in parts:
            f.write(np.ascontiguousarray(p, dtype=dtype).data)


def write_batch(directory: Path, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Write ``samples`` (the trainer's sample dicts) as a batch directory; returns the request's
    ``batch`` entry. Written to ``<directory>.tmp`` and renamed: a reader never sees half a batch.
    Blocking: call it in a worker thread."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)  # a retried step's earlier files
    tmp.mkdir(parents=True)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (*TOKEN_FILES, *OPTIONAL_FILES)}
    meta: list[dict[str, Any]] = []
    any_mask = any(s.get("loss_mask") is not None for s in samples)
    for i, s in enumerate(samples):
        unknown = sorted(set(s) - KNOWN_FIELDS)
        if unknown:  # a field the files have no column for would be lost on the way
            raise BatchFileError(f"samples[{i}] has fields a batch directory does not carry: {unknown}")
        prompt = _flat(s["prompt_ids"], np.int32, f"samples[{i}].prompt_ids")
        response = _flat(s["response_ids"], np.int32, f"samples[{i}].response_ids")
        logprobs = _flat(s["rollout_logprobs"], np.float32, f"samples[{i}].rollout_logprobs")
        if logprobs.size != response.size:
            raise BatchFileError(f"samples[{i}]: rollout_logprobs ({logprobs.size}) and response_ids "
                                 f"({response.size}) differ in length")
        cols["prompt_ids"].append(prompt)
        cols["response_ids"].append(response)
        cols["rollout_logprobs"].append(logprobs)
        entry = {"prompt_tokens": int(prompt.size), "response_tokens": int(response.size)}
        if any_mask:
            mask = s.get("loss_mask")
            cols["loss_mask"].append(np.ones(response.size, np.uint8) if mask is None
                                     else _flat(mask, np.uint8, f"samples[{i}].loss_mask"))
            entry["loss_mask"] = mask is not None
        routed = s.get("routed_experts")
        if routed is not None:
            ids = routed_array(routed)
            cols["routed_experts"].append(ids)
            entry["routed_ids"] = int(ids.size)
        for k in SCALAR_FIELDS:
            if s.get(k) is not None:
                entry[k] = s[k]
        meta.append(entry)
    routed_parts = cols["routed_experts"]
    if routed_parts and len(routed_parts) != len(samples):
        raise BatchFileError("routed_experts: some samples of the batch carry them and some do not")
    for name, dtype in TOKEN_FILES.items():
        _save(tmp / f"{name}.npy", cols[name], dtype)
    if any_mask:
        _save(tmp / "loss_mask.npy", cols["loss_mask"], np.uint8)
    if routed_parts:
        top = max((int(p.max()) for p in routed_parts if p.size), default=0)
        _save(tmp / "routed_experts.npy", routed_parts, expert_dtype(top + 1))
    os.replace(tmp, directory)
    return {"dir": str(directory), "samples": meta}


@dataclass
class BatchSample:
    """One sample of a batch directory, in the trainer's sample fields. The arrays of the rows a
    rank trains are its own copies; the other rows' are views into the mapped files, never read
    (the trainer takes only their lengths)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    reward: float | None = None
    group_id: Any = None
    version: int | None = None
    advantage: float | None = None
    loss_mask: np.ndarray | None = None
    routed_experts: np.ndarray | None = None


def _int(entry: Mapping[str, Any], key: str, where: str) -> int:
    v = entry.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BatchFileError(f"{where}.{key} must be an integer >= 0, got {v!r}")
    return v


def entry_lengths(entry: Mapping[str, Any]) -> list[int]:
    """Each sample's prompt + response tokens (what the trainer plans a step by)."""
    return [int(s["prompt_tokens"]) + int(s["response_tokens"]) for s in entry["samples"]]


class BatchReader:
    """A batch directory opened for one rank: the files are mapped, nothing is read until
    :meth:`samples` copies out a rank's rows. ``bytes_read`` counts what was copied."""

    def __init__(self, entry: Mapping[str, Any]) -> None:
        if not isinstance(entry, Mapping):
            raise BatchFileError("'batch' must be an object with 'dir' and 'samples'")
        if not isinstance(entry.get("dir"), str):
            raise BatchFileError("batch.dir must be the batch directory's path")
        meta = entry.get("samples")
        if not isinstance(meta, list) or not meta:
            raise BatchFileError("batch.samples must be a non-empty list")
        self.dir = Path(entry["dir"])
        self.meta = meta
        self.bytes_read = 0
        counts = {"prompt_ids": [], "response_ids": [], "routed_experts": []}
        for i, s in enumerate(meta):
            where = f"batch.samples[{i}]"
            if not isinstance(s, dict):
                raise BatchFileError(f"{where} must be an object")
            counts["prompt_ids"].append(_int(s, "prompt_tokens", where))
            counts["response_ids"].append(_int(s, "response_tokens", where))
            if s["response_tokens"] == 0:
                raise BatchFileError(f"{where}.response_tokens is 0 (no token to train on)")
            if "routed_ids" in s:
                counts["routed_experts"].append(_int(s, "routed_ids", where))
            has_adv = isinstance(s.get("advantage"), (int, float)) and not isinstance(s.get("advantage"), bool)
            has_reward = isinstance(s.get("reward"), (int, float)) and "group_id" in s
            if not (has_adv or has_reward):
                raise BatchFileError(f"{where} needs a numeric 'advantage', or 'reward' with 'group_id'")
        if counts["routed_experts"] and len(counts["routed_experts"]) != len(meta):
            raise BatchFileError("batch.samples: routed_ids is given for some samples and not others")
        counts["rollout_logprobs"] = counts["response_ids"]
        self.arrays: dict[str, np.ndarray] = {}
        self.offsets: dict[str, np.ndarray] = {}
        names = [*TOKEN_FILES, *(["routed_experts"] if counts["routed_experts"] else []),
                 *(["loss_mask"] if any("loss_mask" in s for s in meta) else [])]
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

    def __len__(self) -> int:
        return len(self.meta)

    def lengths(self) -> list[int]:
        return entry_lengths({"samples": self.meta})

    def _slice(self, name: str, i: int, copy: bool) -> np.ndarray | None:
        arr = self.arrays.get(name)
        if arr is None:
            return None
        view = arr[self.offsets[name][i]:self.offsets[name][i + 1]]
        if not copy:
            return view
        self.bytes_read += view.nbytes
        return np.array(view)  # the read: this rank's own copy

    def samples(self, rows: Sequence[int] | set[int]) -> list[BatchSample]:
        """Every sample of the batch, in order; the arrays of ``rows`` (this rank's share) are read
        into memory, the others stay unread views with the right lengths."""
        own = set(rows)
        out = []
        for i, s in enumerate(self.meta):
            read = i in own
            mask = self._slice("loss_mask", i, read) if s.get("loss_mask") else None
            out.append(BatchSample(
                prompt_ids=self._slice("prompt_ids", i, read), response_ids=self._slice("response_ids", i, read),
                rollout_logprobs=self._slice("rollout_logprobs", i, read), reward=s.get("reward"),
                group_id=s.get("group_id"), version=s.get("version"), advantage=s.get("advantage"),
                loss_mask=mask, routed_experts=self._slice("routed_experts", i, read)))
        return out


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


def routed_text(routed: Any) -> str | None:
    """A sample's routed experts in SGLang's encoding (base64 of little-endian int32): what the
    journal, the checkpoint and a ``/train`` body carry."""
    if routed is None or isinstance(routed, str):
        return routed
    return base64.b64encode(np.asarray(routed).astype("<i4").tobytes()).decode("ascii")
