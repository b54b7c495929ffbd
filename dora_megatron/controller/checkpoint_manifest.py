"""Checksum manifests of resumable checkpoints, and the choice of the checkpoint to resume from.

WHY: a ``dist_checkpointing`` directory carries no checksums. A truncated shard makes the load
fail deep inside torch with a long traceback, and bytes garbled in place load silently as
wrong weights or optimizer state. Every checkpoint therefore gets ``manifest.json`` (size and
SHA-256 of each file, written before ``controller.json``, the completion marker); ``--resume``
verifies the newest complete checkpoint against it and falls back to the previous good one,
saying which file of which checkpoint is bad. Stdlib only: the launcher runs this before any
process starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypedDict


class FileEntry(TypedDict):
    """One file of a checkpoint's ``manifest.json``."""

    size: int
    sha256: str

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
COMPLETE = "controller.json"
QUARANTINE_PREFIX = "bad-"


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(root: Path, files: Iterable[Path]) -> dict[str, FileEntry]:
    """``{relative path: {"size", "sha256"}}`` of ``files`` (paths under ``root``)."""
    out: dict[str, FileEntry] = {}
    for p in sorted(files):
        out[p.relative_to(root).as_posix()] = {"size": p.stat().st_size, "sha256": file_digest(p)}
    return out


def describe_tree(root: Path, sub: str) -> dict[str, FileEntry]:
    """Every regular file under ``root/sub``, keyed by its path relative to ``root``."""
    base = root / sub
    return describe_files(root, (p for p in base.rglob("*") if p.is_file())) if base.is_dir() else {}


def write_manifest(root: Path, entries: dict[str, FileEntry]) -> Path:
    """Write ``root/manifest.json`` atomically."""
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": 1, "files": entries}, indent=1, sort_keys=True))
    os.replace(tmp, root / MANIFEST)
    return root / MANIFEST


def verify(root: Path) -> list[str]:
    """Problems of checkpoint ``root`` against its manifest (empty: intact; one without a manifest
    is not this version's: :func:`choose_checkpoint` refuses it before asking)."""
    path = root / MANIFEST
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        files = json.loads(path.read_text())["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        return [f"{path}: unreadable manifest ({err})"]
    problems = []
    for rel, want in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != want.get("size"):
            problems.append(f"{p}: {size} bytes, expected {want.get('size')} (truncated or overwritten)")
            continue
        if file_digest(p) != want.get("sha256"):
            problems.append(f"{p}: SHA-256 differs from the manifest (corrupted in place)")
    return problems


def has_manifest(root: Path) -> bool:
    return (root / MANIFEST).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (with ``controller.json``), oldest first."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("v*") if (p / COMPLETE).is_file())


def missing_snapshots(root: Path, snapshot_dir: Callable[[int], Path]) -> list[str]:
    """Per-version weight snapshots that resuming from ``root`` loads and that no longer exist
    (pruned): the versions of its unconsumed groups and its own version."""
    try:
        state = json.loads((root / COMPLETE).read_text())
        # a group's version is the orchestrator snapshot's
        orch = {g["group_id"]: g for g in state["orchestrator"]["groups"]}
        versions = {int(orch[g["group_id"]]["version"]) for g in state["groups"]}
        versions.add(int(state["version"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{root / COMPLETE}: unreadable ({err})"]
    # version 0 is the initial model (``model.path`` or a preset the launcher re-creates)
    return [str(snapshot_dir(v)) for v in sorted(versions) if v > 0 and not Path(snapshot_dir(v)).exists()]


@dataclass
class Choice:
    checkpoint: Path | None
    rejected: list[tuple[Path, list[str]]] = field(default_factory=list)  # (checkpoint, problems), newest first
    quarantined: dict[Path, Path] = field(default_factory=dict)  # bad checkpoint -> where it was moved

    def error(self, run_dir: Path) -> str:
        """The message when no checkpoint is usable."""
        if not self.rejected:
            return f"--resume {run_dir}: no complete checkpoint under {Path(run_dir) / 'checkpoints'}"
        lines = [f"--resume {run_dir}: no usable checkpoint:"]
        for ck, problems in self.rejected:
            lines.append(f"  {ck}:")
            lines += [f"    {p}" for p in problems]
        return "\n".join(lines)


def choose_checkpoint(run_dir: Path, snapshot_dir: Callable[[int], Path], say: Callable[[str], None] = log.warning,
                      quarantine: bool = True) -> Choice:
    """The newest complete checkpoint that matches its manifest and whose weight snapshots exist.

    Every rejected one is reported through ``say``. When a good one is found, the corrupt newer ones
    are (with ``quarantine``) renamed to ``checkpoints/bad-vNNNNNN``, so that neither a later resume
    nor the re-run steps (which write the same checkpoint names again) meet them; they are kept for
    inspection. When none is usable nothing is moved (:meth:`Choice.error` names every problem)."""
    choice = Choice(None)
    corrupt: list[Path] = []
    for ck in reversed(complete_checkpoints(run_dir)):
        if not has_manifest(ck):  # every checkpoint this version writes has one: not corrupt, not resumable
            why = f"{ck / MANIFEST}: missing: written by an older dora; this version cannot resume from it"
            say(f"checkpoint {ck} cannot be resumed: {why}")
            choice.rejected.append((ck, [why]))
            continue
        problems = verify(ck)
        if problems:
            say(f"checkpoint {ck} is corrupt: " + "; ".join(problems))
            choice.rejected.append((ck, problems))
            corrupt.append(ck)
            continue
        missing = missing_snapshots(ck, snapshot_dir)
        if missing:
            say(f"checkpoint {ck} cannot be resumed: weight snapshot(s) {', '.join(missing)} no longer exist")
            choice.rejected.append((ck, [f"{m}: missing weight snapshot" for m in missing]))
            continue
        for bad in corrupt if quarantine else ():
            dest = bad.with_name(QUARANTINE_PREFIX + bad.name)
            n = 1
            while dest.exists():
                dest = bad.with_name(f"{QUARANTINE_PREFIX}{bad.name}.{n}")
                n += 1
            os.replace(bad, dest)
            choice.quarantined[bad] = dest
            say(f"moved the corrupt checkpoint {bad} to {dest}")
        if choice.rejected:
            say(f"falling back to the previous good checkpoint {ck}")
        choice.checkpoint = ck
        return choice
    return choice
