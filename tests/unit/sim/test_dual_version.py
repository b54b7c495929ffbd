"""The simulator's model of an instance holding two versions (``orchestrator.dual_version``): a
decode step over both versions' batches reads two weight sets, a kept tail finishes on its own
version, and a two-instance run with S = 3 keeps every contract while it uses dual switches."""

from pathlib import Path

from dora_megatron.config.sim import load_sim_config
from dora_megatron.sim.cost import DecodeCost
from dora_megatron.sim.engine import Simulation
from tests.helpers.sim import assert_run_invariants

TWO = Path(__file__).resolve().parents[3] / "configs" / "sim" / "two_instances.yaml"


def test_dual_step_costs_two_memory_bound_steps():
    """Two small (memory-bound) batches decoded in one dual step cost what the per-step model says
    for each batch on its own, i.e. two weight reads, not one."""
    c = DecodeCost(overhead_s=0.002, weight_s=0.02, kv_s_per_token=1e-7, compute_s_per_seq=1e-4)
    both = c.dual().step_s(3, 3000 + 5000)
    assert abs(both - (c.step_s(1, 3000) + c.step_s(2, 5000))) < 1e-12
    assert both > c.step_s(3, 8000)


def test_two_instances_with_dual_version_keep_the_contract_and_use_it():
    extra = ["sim.steps=12", "sim.warmup_steps=1"]
    off = Simulation(load_sim_config(TWO, extra, mode="dora"))
    r_off = off.run()
    on = Simulation(load_sim_config(TWO, extra + ["orchestrator.dual_version=true"], mode="dora"))
    r_on = on.run()
    assert_run_invariants(on, r_on, steps=12)  # C1 included: tails finish on their own version
    assert r_off.extra["dual_switches"] == 0 and r_off.extra["dual_weight_instance_s"] == 0
    assert r_on.extra["dual_switches"] > 0 and r_on.extra["dual_weight_instance_s"] > 0
    assert r_on.extra["orchestrator_summary"]["dual_switches"] == r_on.extra["dual_switches"]
