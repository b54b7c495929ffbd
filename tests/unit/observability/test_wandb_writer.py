"""``observability.wandb``: the step scalars go to a real W&B run, offline when there is no login
(no network is ever tried), in ``RUN_DIR/wandb``."""

from __future__ import annotations

import pytest

from dora_megatron.observability.wandb_writer import WandbWriter, wandb_mode


def test_mode_is_offline_without_credentials(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_mode({}, netrc) == "offline"  # no file at all
    netrc.write_text("machine example.org login x password y\n")
    assert wandb_mode({}, netrc) == "offline"
    netrc.write_text("machine api.wandb.ai login user password key\n")
    assert wandb_mode({}, netrc) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k"}, tmp_path / "none") == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, netrc) == "disabled"


def test_scalars_are_recorded_in_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline by itself
    run_dir = tmp_path / "cpu_own_model-dora-20261202-000000"
    w = WandbWriter(run_dir, "dora-test", config={"data": {"task": "dataset"}})
    assert w.mode == "offline"
    w.scalars(0, {"reward/mean": 0.123456, "perf/step_time_s": None})
    w.scalars(1, {"reward/mean": 0.654321})
    w.close()
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()  # the run's record log: keys and values as W&B stores them
    assert b"reward/mean" in data and b"0.123456" in data and b"0.654321" in data
    assert b"perf/step_time_s" not in data  # a metric that does not apply is not logged as a number
