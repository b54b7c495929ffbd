"""Per-version Hugging Face snapshots on disk: atomic writes, a store with retention, verification.

WHY: the disk transport (``/update_weights_from_disk``) and late-joining instances of an older
live version both load a version's weights from a directory ``<root>/vNNNNNN``. A snapshot must
be complete or absent (engines may read it while the trainer writes the next one), so it is
written to a temporary sibling directory and renamed. Each snapshot records its version, the
checksum of its tensors (:func:`dora_megatron.comm.checksum.weights_checksum`, the same number
the engines report) and the byte size of every file, so a truncated or corrupted file is found
with a clear message before an engine loads it. Old versions are pruned once no live instance
or in-flight group can still need them (the caller decides ``keep_from``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

import msgspec

from dora_megatron.models.fp8_checkpoint import QUANT_KEY, without_quantization

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MANIFEST = "dora_version.json"
WEIGHTS_FILE = "model.safetensors"
#: Files copied from the source model directory next to the weights (config first, required).
SNAPSHOT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class SnapshotError(RuntimeError):
    """A snapshot is missing, incomplete, truncated or does not match its recorded checksum."""


class Manifest(msgspec.Struct):
    """A snapshot's ``dora_version.json``: written last, so a directory holding one is complete."""

    checksum: str  # comm.checksum.weights_checksum of model.safetensors' tensors
    files: dict[str, int] = {}  # each file's size in bytes
    version: int | None = None
    num_tensors: int | None = None


def version_dir_name(version: int) -> str:
    return f"v{int(version):06d}"


def write_snapshot(out_dir: str | Path, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   config_src_dir: str | Path, version: int | None = None) -> str:
    """Write ``out_dir`` atomically (``config.json`` + tokenizer files from ``config_src_dir``,
    ``model.safetensors``, manifest); returns the weights checksum.

    ``tensors``: HF-named CPU tensors (a mapping or (name, tensor) pairs). An existing ``out_dir``
    is replaced. A crash leaves at most a ``<name>.tmp`` directory, never a partial snapshot."""
    from safetensors.torch import save_file

    from dora_megatron.comm.checksum import weights_checksum

    out_dir = Path(out_dir)
    src = Path(config_src_dir)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    state = {name: t.detach().cpu().contiguous() for name, t in items}
    if not (src / SNAPSHOT_FILES[0]).is_file():
        raise FileNotFoundError(f"no {SNAPSHOT_FILES[0]} in {src}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in SNAPSHOT_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    # the weights written here are never quantized: an FP8 source's quantization_config must not
    # make an engine read them as FP8
    config = json.loads((src / SNAPSHOT_FILES[0]).read_text())
    if QUANT_KEY in config:
        (tmp / SNAPSHOT_FILES[0]).write_text(json.dumps(without_quantization(config), indent=2) + "\n")
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    checksum = weights_checksum(state)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = Manifest(checksum=checksum, files=files, version=version, num_tensors=len(state))
    (tmp / MANIFEST).write_text(json.dumps(msgspec.structs.asdict(manifest), indent=1, sort_keys=True) + "\n")
    _fsync_dir(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)  # atomic on one file system
    return checksum


def _fsync_dir(path: Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def read_manifest(snapshot_dir: str | Path) -> Manifest:
    path = Path(snapshot_dir) / MANIFEST
    if not path.is_file():
        raise SnapshotError(f"{snapshot_dir}: no {MANIFEST} (not a snapshot, or an interrupted write)")
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"{path}: unreadable manifest ({exc})") from None


def verify_snapshot(snapshot_dir: str | Path) -> str:
    """Check every file's size and the tensors' checksum against the manifest; returns the checksum.

    Raises :class:`SnapshotError` naming the file and what is wrong (missing, truncated, grown,
    unreadable safetensors, checksum mismatch)."""
    from safetensors.torch import load_file

    from dora_megatron.comm.checksum import weights_checksum

    d = Path(snapshot_dir)
    manifest = read_manifest(d)
    for name, size in manifest.files.items():
        p = d / name
        if not p.is_file():
            raise SnapshotError(f"{p}: missing")
        actual = p.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "larger than recorded"
            raise SnapshotError(f"{p}: {what} ({actual} bytes, manifest says {size})")
    try:
        state = load_file(str(d / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise SnapshotError(f"{d / WEIGHTS_FILE}: unreadable ({str(exc)[:200]})") from None
    checksum = weights_checksum(state)
    if checksum != manifest.checksum:
        raise SnapshotError(f"{d}: weights checksum {checksum[:16]}... != recorded {manifest.checksum[:16]}... "
                            "(corrupted file)")
    return checksum


class SnapshotStore:
    """Versioned snapshots under one root: ``root/v000000``, ``root/v000001``, ..."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def write(self, version: int, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
              config_src_dir: str | Path) -> str:
        """Write version ``version``'s snapshot; returns its checksum."""
        return write_snapshot(self.path(version), tensors, config_src_dir, version=version)

    def versions(self) -> list[int]:
        """Complete snapshots (a manifest is present), ascending."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        vs = self.versions()
        return vs[-1] if vs else None

    def checksum(self, version: int) -> str:
        """The recorded checksum (no re-hash; see :meth:`verify`)."""
        return read_manifest(self.path(version)).checksum

    def verify(self, version: int) -> str:
        if not self.path(version).is_dir():
            raise SnapshotError(f"no snapshot of version {version} in {self.root}")
        return verify_snapshot(self.path(version))

    def prune(self, keep_from: int) -> list[int]:
        """Delete snapshots of versions ``< keep_from`` (and stale ``.tmp`` dirs); returns the removed versions."""
        removed = []
        for v in self.versions():
            if v < keep_from:
                shutil.rmtree(self.path(v), ignore_errors=True)
                removed.append(v)
        if self.root.is_dir():
            for p in self.root.iterdir():
                m = _VERSION_DIR.match(p.name[:-4]) if p.name.endswith(".tmp") else None
                if m and int(m.group(1)) < keep_from:
                    shutil.rmtree(p, ignore_errors=True)
        if removed:
            log.info("pruned snapshots %s from %s", removed, self.root)
        return removed
