"""The controller part of a checkpoint (``controller.json``) written in slices the event loop can
interleave with its other work.

WHY: at thousands of instances the state holds tens of thousands of samples; ``json.dumps`` of it
is one C call of 0.2-1 s, and in a thread it would hold the GIL (so the loop) just as long. The state
itself is taken in one loop turn (a consistent cut, see ``ControllerState.write``); only
its encoding and writing are spread: :func:`json_chunks` yields the exact text of
``json.dumps(state)`` a bounded piece at a time, and :func:`write_state` is a generator that does
one piece of file work per step, so a task can drive it with a loop turn between steps and the
run's last checkpoint (or a caller that must finish now) can drain it at once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from dora_megatron.controller.checkpoint_manifest import write_manifest

# items of a long list encoded per json.dumps call (a few ms at checkpoint record sizes)
SLICE_ITEMS = 256
# text gathered before the writer yields to the loop
CHUNK_CHARS = 1 << 18


def _pieces(value: Any, slice_items: int) -> Iterator[str]:
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield (", " if i else "") + json.dumps(k) + ": "
            yield from _pieces(v, slice_items)
        yield "}"
    elif isinstance(value, list) and len(value) > slice_items:
        yield "["
        for i in range(0, len(value), slice_items):
            yield (", " if i else "") + json.dumps(value[i:i + slice_items])[1:-1]
        yield "]"
    else:
        yield json.dumps(value)  # anything else (and dicts with non-str keys) as json.dumps has it


def json_chunks(value: Any, slice_items: int = SLICE_ITEMS, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """``json.dumps(value)`` (default separators), as consecutive pieces of about ``chunk_chars``:
    long lists are encoded ``slice_items`` at a time, so no single encoding call is large."""
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


def write_state(path: Path, state: dict[str, Any], trainer_entries: dict[str, dict],
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
