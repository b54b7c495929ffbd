"""tools/sim_stranding.py: on two one-version instances the newest version is stranded only behind
two *different* older versions (so no same-version migration can free an instance); four
instances host every live version of S = 3."""

from pathlib import Path

from tests.helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[3]
TWO = ROOT / "configs" / "sim" / "two_instances.yaml"


def _tool():
    return load_tool("sim_stranding")


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


def test_a_real_runs_trace_counts_the_time_no_engine_holds_or_loads_the_newest_version():
    def span(tid, cat, start, end, **args):
        return {"ph": "X", "tid": tid, "cat": cat, "ts": start * 1e6, "dur": (end - start) * 1e6, "args": args}

    meta = [{"ph": "M", "tid": t, "args": {"name": n}} for t, n in ((0, "engine0"), (1, "engine1"), (2, "trainer"))]
    events = meta + [
        span(2, "train", 0, 1, produced=1), span(2, "train", 1, 3, produced=2), span(2, "train", 3, 5, produced=3),
        span(0, "version", 0, 2, version=0), span(0, "weight_sync", 2, 2.5, version=2), span(0, "version", 2.5, 9, version=2),
        span(1, "version", 0, 9, version=1),
        span(0, "request", 0, 2), span(1, "request", 0, 5), span(1, "request", 0, 5),
    ]
    res = _tool().trace_stranding(events, cap=2)
    # measured from the first step's end (1) to the last one's (5): v1 is newest in [1, 3] and engine1 holds
    # it; v2 is newest in [3, 5] and engine0 holds it from 2.5 (loading from 2): never stranded
    assert res["stranded_fraction"] == 0.0
    # the same run where engine0 only loads v2 at 4: stranded in [3, 4] behind versions 0 (age 2) and 1 (age 1)
    late = [e for e in events if not (e["tid"] == 0 and e.get("cat") in ("weight_sync", "version"))] + [
        span(0, "version", 0, 4, version=0), span(0, "weight_sync", 4, 4.5, version=2), span(0, "version", 4.5, 9, version=2)]
    res = _tool().trace_stranding(late, cap=2)
    assert res["stranded_fraction"] == 0.25  # 1 s of the 4 s from the first to the last step's end
    assert res["by_pool"] == {"[1, 2]": 1.0}
    # [3, 4]: engine0 runs nothing (2 empty of 2), engine1 runs 2 (0 empty): half the slots empty for 1 s of 4
    assert res["idle_slots_stranded"] == 0.5 * 1 / 4
