"""Snapshots: atomic layout, checksum equal to the engine's definition, verification, retention."""

from __future__ import annotations

import json

import pytest
import torch

from dora_megatron.comm.checksum import weights_checksum
from dora_megatron.weights.snapshots import MANIFEST, WEIGHTS_FILE, SnapshotError, SnapshotStore, write_snapshot


@pytest.fixture()
def src(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (d / "tokenizer.json").write_text("{}")
    return d


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g), "model.norm.weight": torch.ones(8),
            "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


def test_write_and_verify(tmp_path, src):
    from safetensors.torch import load_file

    t = tensors(0)
    out = tmp_path / "snap" / "v000003"
    checksum = write_snapshot(out, t, src, version=3)
    assert checksum == weights_checksum(t)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "tokenizer.json", WEIGHTS_FILE, MANIFEST])
    assert not (tmp_path / "snap" / "v000003.tmp").exists()
    loaded = load_file(str(out / WEIGHTS_FILE))
    assert all(torch.equal(loaded[k], t[k]) and loaded[k].dtype == t[k].dtype for k in t)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["version"] == 3 and manifest["checksum"] == checksum
    store = SnapshotStore(tmp_path / "snap")
    assert store.verify(3) == checksum == store.checksum(3)
    # overwrite with other weights: replaced, not merged
    assert write_snapshot(out, tensors(1), src, version=3) == weights_checksum(tensors(1)) != checksum


def test_verify_detects_truncation_corruption_and_missing(tmp_path, src):
    store = SnapshotStore(tmp_path)
    store.write(1, tensors(0), src)
    store.write(2, tensors(1), src)
    store.write(4, tensors(2), src)
    weights = store.path(1) / WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="truncated"):
        store.verify(1)
    p2 = store.path(2) / WEIGHTS_FILE
    raw = bytearray(p2.read_bytes())
    raw[-3] ^= 0xFF  # flip bits inside tensor data, same size
    p2.write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match="checksum"):
        store.verify(2)
    (store.path(4) / "tokenizer.json").unlink()
    with pytest.raises(SnapshotError, match="missing"):
        store.verify(4)
    with pytest.raises(SnapshotError, match="no snapshot of version 7"):
        store.verify(7)


def test_store_versions_prune_and_tmp_ignored(tmp_path, src):
    store = SnapshotStore(tmp_path)
    assert store.versions() == [] and store.latest() is None
    for v in (0, 1, 2, 5):
        store.write(v, tensors(v), src)
    (tmp_path / "v000001.tmp").mkdir()  # interrupted write: not a version
    (tmp_path / "v000009").mkdir()  # no manifest: not complete
    assert store.versions() == [0, 1, 2, 5] and store.latest() == 5
    assert store.prune(keep_from=2) == [0, 1]
    assert store.versions() == [2, 5]
    assert not (tmp_path / "v000001.tmp").exists() and (tmp_path / "v000009").exists()
    assert store.verify(5) == weights_checksum(tensors(5))


def test_missing_config_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_snapshot(tmp_path / "v000000", tensors(0), tmp_path / "empty")
    assert not (tmp_path / "v000000").exists()


def test_versioned_worker_export_snapshot_uses_atomic_writer(tmp_path, src):
    from dora_megatron.trainer.service import VersionedWorker

    class Fake:
        def export_hf_state_dict(self):
            return iter(tensors(4).items())

    w = VersionedWorker(Fake(), str(src), rank=0)
    w.version = 4
    store = SnapshotStore(tmp_path / "weights")
    checksum = w.export_snapshot(store.path(4))
    assert checksum == weights_checksum(tensors(4)) == store.verify(4)
    assert json.loads((store.path(4) / MANIFEST).read_text())["version"] == 4
    assert VersionedWorker(Fake(), str(src), rank=1).export_snapshot(store.path(5)) is None  # only rank 0 writes
    assert store.versions() == [4]


def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(tmp_path, src):
    store = SnapshotStore(tmp_path)
    store.write(1, tensors(0), src)
    manifest = store.path(1) / MANIFEST
    recorded = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**recorded, "files": {"model.safetensors": "big"}}))
    with pytest.raises(SnapshotError, match=r"unreadable manifest.*\$\.files"):
        store.verify(1)
    manifest.write_text(json.dumps({k: v for k, v in recorded.items() if k != "checksum"}))
    with pytest.raises(SnapshotError, match="unreadable manifest.*checksum"):
        store.checksum(1)
