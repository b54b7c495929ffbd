"""tools/sim_sweep.py: variants x modes against the bound, and bad input is a usage error."""

import json
from pathlib import Path

import pytest

from tests.helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "sim" / "tiny.yaml"


def _tool():
    return load_tool("sim_sweep")


def test_sweep_reports_bound_and_ratios_per_variant(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = _tool().main(["--config", str(TINY), "--set", "sim.steps=3", "--set", "sim.warmup_steps=1", "--jobs", "1",
                       "--modes", "sync", "dora", "--variant", "base:", "--variant",
                       "kv:cost.kv_capacity_tokens=8000", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) == {"base", "kv"} and set(res["kv"]) == {"sync", "dora"}
    # the KV-bound variant has a smaller instance, so a smaller rollout capacity
    assert res["kv"]["dora"]["bound"]["rollout_tokens_per_s"] < res["base"]["dora"]["bound"]["rollout_tokens_per_s"]
    table = capsys.readouterr().out
    assert "| kv | dora |" in table and "1.00x" in table


@pytest.mark.parametrize("bad", ["novariantname", "x:notkeyvalue"])
def test_bad_variant_is_a_usage_error(bad):
    with pytest.raises(SystemExit) as err:
        _tool().main(["--config", str(TINY), "--variant", bad])
    assert err.value.code == 2


def test_bad_override_is_a_config_error(capsys):
    assert _tool().main(["--config", str(TINY), "--jobs", "1", "--modes", "dora", "--variant", "v:cluster.nope=1"]) == 2
    assert "cluster.nope" in capsys.readouterr().err
