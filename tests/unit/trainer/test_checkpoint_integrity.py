"""A corrupt trainer checkpoint on ``--resume``: fall back to the previous good one, or fail clearly.

Uses a real Megatron ``dist_checkpointing`` directory (tiny MoE, one rank, saved by
``tests.helpers.trainer_programs resume-save``). Garbling bytes in place does not make the torch
load fail (it silently loads other numbers), truncating does (deep inside torch): the checksum
manifest written next to every checkpoint catches both before any process starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dora_megatron.controller.checkpoint_manifest import (MANIFEST, choose_checkpoint, describe_tree, verify,
                                                          write_manifest)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def _scenario(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tests.helpers.trainer_programs", *args], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model dir, a real dist_checkpointing trainer directory)."""
    from dora_megatron.models.presets import create_model_dir

    base = tmp_path_factory.mktemp("ckpt")
    model = base / "model"
    create_model_dir("tiny-moe", model, seed=0)
    r = _scenario("resume-save", "--hf", str(model), "--ckpt", str(base / "trainer"), "--out", str(base / "out.pt"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return model, base / "trainer"


def _state(version: int) -> bytes:
    """What :func:`~dora_megatron.controller.checkpoint_manifest.missing_snapshots` reads of a
    ``controller.json``: its version, and one outstanding group of the version before (its version
    is the orchestrator snapshot's)."""
    return json.dumps({"version": version, "groups": [{"group_id": "g0"}],
                       "orchestrator": {"groups": [{"group_id": "g0", "version": version - 1}]}}).encode()


def make_checkpoint(run_dir: Path, version: int, trainer_dir: Path | None) -> Path:
    """A complete checkpoint as the runtime writes it: trainer/ (none: without trainer files),
    manifest.json, controller.json last."""
    ck = run_dir / "checkpoints" / f"v{version:06d}"
    if trainer_dir is not None:
        shutil.copytree(trainer_dir, ck / "trainer")
    else:
        ck.mkdir(parents=True)
    state = _state(version)
    entries = describe_tree(ck, "trainer") if trainer_dir is not None else {}
    import hashlib

    entries["controller.json"] = {"size": len(state), "sha256": hashlib.sha256(state).hexdigest()}
    write_manifest(ck, entries)
    (ck / "controller.json").write_bytes(state)
    for v in (version - 1, version):  # the weight snapshots it needs
        (run_dir / "weights" / f"v{v:06d}").mkdir(parents=True, exist_ok=True)
    return ck


def test_garbled_latest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, saved):
    model, trainer_dir = saved
    run_dir = tmp_path / "run"
    good = make_checkpoint(run_dir, 2, trainer_dir)
    latest = make_checkpoint(run_dir, 4, trainer_dir)
    shard = next(p for p in sorted((latest / "trainer").glob("*.distcp")))
    with open(shard, "r+b") as f:  # garble in place: same size
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    said: list[str] = []
    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=said.append)
    assert choice.checkpoint == good
    text = "\n".join(said)
    assert f"checkpoint {latest} is corrupt" in text and shard.name in text and "SHA-256" in text
    assert f"falling back to the previous good checkpoint {good}" in text
    # the bad one is kept for inspection but out of the way of a later resume and of the re-run steps
    assert not latest.exists() and (run_dir / "checkpoints" / "bad-v000004" / MANIFEST).is_file()
    assert verify(good) == []
    # the chosen checkpoint loads with the real dist_checkpointing and trains on
    r = _scenario("resume-load", "--hf", str(model), "--ckpt", str(good / "trainer"), "--out", str(tmp_path / "l.pt"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_only_checkpoint_truncated_fails_with_the_path_and_no_traceback(tmp_path, saved, caplog, capsys):
    from dora_megatron.config.schema import load_config
    from dora_megatron.launch.local import run_local_job

    _, trainer_dir = saved
    run_dir = tmp_path / "run"
    only = make_checkpoint(run_dir, 2, trainer_dir)
    shard = next(p for p in sorted((only / "trainer").glob("*.distcp")))
    os.truncate(shard, shard.stat().st_size // 3)
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml")
    caplog.set_level(logging.INFO)
    assert run_local_job(cfg, resume=str(run_dir)) == 2
    out = caplog.text + capsys.readouterr().err
    assert f"--resume {run_dir.resolve()}: no usable checkpoint" in out
    assert str(shard.resolve()) in out and "truncated" in out
    assert "Traceback" not in out
    assert only.is_dir() and (only / "controller.json").is_file()  # nothing moved when nothing is usable
    assert not (run_dir / "processes.json").exists()  # failed before starting any process


def test_a_checkpoint_whose_weight_snapshot_was_pruned_is_skipped(tmp_path):
    run_dir = tmp_path / "run"
    for v in (2, 4):
        make_checkpoint(run_dir, v, None)
    shutil.rmtree(run_dir / "weights" / "v000003")  # (needed by v4's unconsumed groups) is gone
    said: list[str] = []
    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=said.append)
    assert choice.checkpoint == run_dir / "checkpoints" / "v000002"
    assert any("v000003" in s and "no longer exist" in s for s in said)


def test_a_checkpoint_without_a_manifest_is_refused_as_older_and_left_in_place(tmp_path):
    """Every checkpoint this version writes has a manifest: one without is an older dora's, refused
    by name (not read unverified), and not moved away as corrupt; an older good one is chosen."""
    run_dir = tmp_path / "run"
    good = make_checkpoint(run_dir, 2, None)
    older = make_checkpoint(run_dir, 4, None)
    (older / MANIFEST).unlink()
    said: list[str] = []
    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=said.append)
    assert choice.checkpoint == good and older.is_dir() and not choice.quarantined
    assert f"checkpoint {older} cannot be resumed: {older / MANIFEST}: missing: written by an older dora" in said[0]
    (good / MANIFEST).unlink()
    choice = choose_checkpoint(run_dir, lambda v: run_dir / "weights" / f"v{v:06d}", say=said.append)
    assert choice.checkpoint is None and "older dora" in choice.error(run_dir)
