"""``dora simulate`` writes the summary JSON (every DESIGN section 11 field) and the PNGs."""

import json
from pathlib import Path

import pytest

from dora_megatron.cli.main import main
from dora_megatron.observability.summary import SUMMARY_FIELDS

TINY = Path(__file__).resolve().parents[3] / "configs" / "sim" / "tiny.yaml"


def test_single_mode_writes_summary_and_plots(tmp_path):
    out = tmp_path / "r.json"
    rc = main(["simulate", "--config", str(TINY), "--mode", "dora", "--set", "sim.steps=3",
               "--set", "sim.warmup_steps=0", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    for key in SUMMARY_FIELDS:
        assert key in data
    assert data["mode"] == "dora" and data["steps"] == 3
    assert len(data["series"]["step_time_s"]) == 3
    assert (tmp_path / "r_steps.png").stat().st_size > 0
    assert (tmp_path / "r_timeline_dora.png").stat().st_size > 0
    assert (tmp_path / "r_overview.png").read_bytes()[:4] == b"\x89PNG"  # the overview dora train draws


def test_bad_override_is_a_config_error(tmp_path, capsys):
    rc = main(["simulate", "--config", str(TINY), "--set", "cluster.nope=1", "--out", str(tmp_path / "x.json"),
               "--no-plots"])
    assert rc == 2
    captured = capsys.readouterr()
    assert "cluster.nope" in captured.err and captured.out == ""


def test_every_mode_reports_its_bound_and_efficiency(tmp_path):
    out = tmp_path / "all.json"
    rc = main(["simulate", "--config", str(TINY), "--mode", "all", "--set", "sim.steps=3",
               "--set", "sim.warmup_steps=1", "--out", str(out), "--no-plots"])
    assert rc == 0
    modes = json.loads(out.read_text())["modes"]
    for name, r in modes.items():
        b = r["bound"]
        assert b["binding"] in ("rollout", "training", "time-shared", "tail"), name
        assert r["efficiency"] == pytest.approx(r["throughput_tokens_per_s"] / b["bound_tokens_per_s"])
    assert modes["dora_elastic"]["bound"]["elastic_instances"] > 0


def test_an_unknown_mode_is_refused_by_its_flag_with_every_valid_mode(tmp_path, capsys):
    from dora_megatron.config.orchestrator import MODES

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--config", str(TINY), "--mode", "fast", "--out", str(tmp_path / "x.json"), "--no-plots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --mode: invalid choice: 'fast'" in err and "orchestrator.mode" not in err
    for mode in (*MODES, "dora_elastic", "all"):
        assert f"'{mode}'" in err, (mode, err)
    assert not (tmp_path / "x.json").exists()
