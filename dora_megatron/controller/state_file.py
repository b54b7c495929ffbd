"""The controller part of a checkpoint (``controller.json``) encoded in bounded slices, by a
writer thread.

WHY: at thousands of instances the state holds tens of thousands of samples, and at reasoning
lengths millions of tokens; ``json.dumps`` of it is one C call of seconds, and in a thread it would
hold the GIL (so the loop) just as long. The state itself is taken in one loop turn (a consistent
cut, see ``ControllerState.write``), holding the finished samples' own arrays (int32 ids, float32
log-probs, routed experts as small integers), not lists; everything proportional to tokens is
done here: :func:`json_chunks` yields the text of ``json.dumps`` of the state with each array as
a list (its numbers written by :func:`~.array_text.array_json`: the same values, ~15x faster;
routed experts as SGLang's base64 text) a bounded piece at a time, so the GIL
passes to the loop between two pieces; :func:`write_state` is a generator that does one piece of
file work per step, which the checkpoint writer (:mod:`.checkpointing`) drains in its own thread
(the run's end waits for the last one, in a thread too).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dora_megatron.comm.batch_files import routed_base64
from dora_megatron.controller.array_text import array_json
from dora_megatron.controller.checkpoint_manifest import FileEntry, write_manifest

# items of a long list encoded per json.dumps call (a few ms at checkpoint record sizes)
SLICE_ITEMS = 256
# text gathered before the writer yields to the loop
CHUNK_CHARS = 1 << 18


# array items (token ids, log-probs) encoded per array_json call
ARRAY_SLICE = 1 << 15


def _pieces(value: Any, slice_items: int) -> Iterator[str]:
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield (", " if i else "") + json.dumps(k) + ": "
            yield from _pieces(v, slice_items)
        yield "}"
    elif isinstance(value, array):  # a sample's token ids or log-probs: its list (array_json's text)
        yield "["
        for i in range(0, len(value), ARRAY_SLICE):
            yield (", " if i else "") + array_json(value[i:i + ARRAY_SLICE])[1:-1].decode("ascii")
        yield "]"
    elif isinstance(value, np.ndarray):  # a sample's routed experts: SGLang's base64 text
        yield '"'
        for piece in routed_base64(value):
            yield piece.decode("ascii")
        yield '"'
    elif isinstance(value, list) and any(isinstance(v, (dict, array, np.ndarray)) for v in value[:1]):
        yield "["  # records (samples, groups): one at a time, each may hold arrays
        for i, v in enumerate(value):
            if i:
                yield ", "
            yield from _pieces(v, slice_items)
        yield "]"
    elif isinstance(value, list) and len(value) > slice_items:
        yield "["
        for i in range(0, len(value), slice_items):
            yield (", " if i else "") + json.dumps(value[i:i + slice_items])[1:-1]
        yield "]"
    else:
        yield json.dumps(value)  # anything else (and dicts with non-str keys) as json.dumps has it


def json_chunks(value: Any, slice_items: int = SLICE_ITEMS, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """``json.dumps(value)`` (default separators; an ``array`` as its list by
    :func:`~.array_text.array_json`, an integer ndarray as SGLang's base64 of int32), as
    consecutive pieces of about ``chunk_chars``: long lists and arrays are encoded a slice at a
    time, so no single encoding call is large."""
    buf: list[str] = []
    n = 0
    for p in _pieces(value, slice_items):
        buf.append(p)
        n += len(p)
        if n >= chunk_chars:
            yield "".join(buf)
            buf, n = [], 0
    if buf:
        yield "".join(buf)


def write_state(path: Path, state: dict[str, Any], trainer_entries: dict[str, FileEntry],
                done: Callable[[], None]) -> Iterator[None]:
    """Write ``path/controller.json`` from ``state``, one chunk per step (yields between them):
    to ``controller.json.tmp`` first, then ``manifest.json`` (the trainer's ``trainer_entries`` plus
    size and SHA-256 of the controller file), then the rename that makes the checkpoint complete;
    ``done()`` runs after it. ``state`` must not change while this runs (the caller's copy)."""
    tmp = path / "controller.json.tmp"
    digest = hashlib.sha256()
    size = 0
    with open(tmp, "wb") as fh:
        for text in json_chunks(state):
            data = text.encode()
            fh.write(data)
            digest.update(data)
            size += len(data)
            yield
    entries = dict(trainer_entries)
    entries["controller.json"] = {"size": size, "sha256": digest.hexdigest()}
    write_manifest(path, entries)
    tmp.rename(path / "controller.json")
    done()
