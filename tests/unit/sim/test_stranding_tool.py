"""tools/sim_stranding.py: on two one-version instances the newest version is stranded only behind
two *different* older versions (so no same-version migration can free an instance); four
instances host every live version of S = 3."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TWO = ROOT / "configs" / "sim" / "two_instances.yaml"


def _tool():
    spec = importlib.util.spec_from_file_location("sim_stranding", ROOT / "tools" / "sim_stranding.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_instances_strand_the_newest_only_behind_two_distinct_older_versions():
    tool = _tool()
    two = tool.measure(str(TWO), ["sim.steps=16"])
    assert two["instances"] == 2 and two["stranded_fraction"] > 0.1
    for pool in two["by_pool"]:
        ages = [int(a) for a in pool.strip("[]").split(",")]
        assert len(set(ages)) == len(ages) and min(ages) >= 1, pool  # never one version on both instances
    four = tool.measure(str(TWO), ["sim.steps=16", "cluster.total_gpus=16"])
    assert four["instances"] == 4 and four["stranded_fraction"] == 0.0


def test_stranding_splits_the_traced_time_by_pool_state():
    tool = _tool()
    # (time, pool while stranded or None, share of the slots empty from then on)
    trace = [(0.0, None, 0.0), (1.0, (1, 2), 0.5), (3.0, None, 0.1), (6.0, (2, 3), 0.25), (7.0, None, 0.0),
             (10.0, None, 0.0)]
    res = tool.stranding(trace)
    assert res["stranded_fraction"] == 0.3  # 2 s + 1 s of 10
    assert res["by_pool"] == {"[1, 2]": 2 / 3, "[2, 3]": 1 / 3}
    assert res["idle_slots_stranded"] == (2 * 0.5 + 1 * 0.25) / 10
    assert res["idle_slots"] == (2 * 0.5 + 3 * 0.1 + 1 * 0.25) / 10
