"""The simulator driving the production orchestrator: determinism, conservation, invariants, and
the qualitative result the project is built on (sync pays the long-tail bubble, dora removes most
of the trainer's wait)."""

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.sim import load_sim_config
from dora_megatron.sim.engine import Simulation, simulate
from dora_megatron.observability.summary import SUMMARY_FIELDS
from tests.helpers.sim import FAST, TINY, assert_run_invariants, assert_sim_checks_clean

TWO_INSTANCES = TINY.with_name("two_instances.yaml")


def _cfg(mode, *extra):
    return load_sim_config(TINY, FAST + list(extra), mode=mode)


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
def test_deterministic_for_a_seed(mode):
    a, b = simulate(_cfg(mode)), simulate(_cfg(mode))
    assert a.summary == b.summary
    assert a.series == b.series
    c = simulate(_cfg(mode, "workload.seed=7"))
    assert c.summary["throughput_tokens_per_s"] != a.summary["throughput_tokens_per_s"]


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
def test_conservation_and_invariants(mode):
    sim = Simulation(_cfg(mode))
    res = sim.run()
    s = res.summary
    assert tuple(k for k in SUMMARY_FIELDS if k in s) == SUMMARY_FIELDS
    assert_run_invariants(sim, res, steps=6)
    if mode == "partial":
        assert s["reprefill_tokens"] > 0  # interrupted requests are re-prefilled


# every mode at every staleness bound it takes (sync is on-policy, one_step_off one step behind)
_MODE_S = [("sync", 0), ("one_step_off", 1)] + [(m, S) for m in ("partial", "dora", "dora_elastic") for S in (0, 1, 2)]


@pytest.mark.parametrize("mode,S", _MODE_S)
def test_exactly_tbs_groups_consumed_per_trained_step(mode, S):
    """Exact TBS and exactly-once: a run of N steps consumes N * TBS groups, each once, all of them
    trained; in particular no batch is released after the last step (its groups would be neither
    trained nor kept for a resume). Five steps, no warm-up, and a trainer slow enough that the next
batch is complete whenever a step ends (the case where a batch after the last one was released)."""
    extra = ["sim.steps=5", "sim.warmup_steps=0", f"orchestrator.max_staleness={S}", "cost.train_fixed_s=300"]
    if mode == "dora_elastic":
        mode, extra = "dora", extra + ["cluster.elastic_colocation=true"]
    sim = Simulation(load_sim_config(TINY, extra, mode=mode))
    res = sim.run()
    s = res.summary
    assert s["steps"] == 5 and res.series["step"] == [0, 1, 2, 3, 4]
    assert s["consumed_groups"] == 5 * s["tbs"]
    consumed = [g for g in sim.groups.values() if g.consumed]
    assert len(consumed) == 5 * s["tbs"] and all(g.consumed == 1 for g in consumed)
    assert sum(s["staleness_histogram"].values()) == 5 * s["tbs"]  # every consumed group was trained
    assert s["lost_groups"] == 0 and s["duplicated_groups"] == 0 and not res.extra["deadlock"]
    assert_sim_checks_clean(res)


def test_dora_keeps_c1_and_moves_requests_by_kv():
    res = simulate(_cfg("dora"))
    s = res.summary
    assert s["c1_violations"] == 0 and s["c3_violations"] == 0
    assert_sim_checks_clean(res)
    assert s["reprefill_tokens"] == 0 and res.extra["sim_reprefill_tokens"] == 0
    assert res.extra["orchestrator_summary"]["max_live_versions"] >= 2


def test_sync_bubble_and_dora_removes_most_waiting():
    # long tail: a few responses 30x the median
    extra = ["workload.response.sigma=1.5", "workload.max_response_tokens=12000", "sim.steps=8"]
    sync = simulate(_cfg("sync", *extra))
    dora = simulate(_cfg("dora", *extra))
    assert min(sync.series["bubble"]) > 0.5  # (max L - mean L) / max L
    assert sync.summary["rollout_only_fraction"] > 0.4
    assert dora.summary["rollout_only_fraction"] < sync.summary["rollout_only_fraction"]
    assert dora.summary["throughput_tokens_per_s"] > sync.summary["throughput_tokens_per_s"]


def test_elastic_colocation_serves_rollout_with_trainer_devices():
    res = simulate(_cfg("dora", "cluster.elastic_colocation=true"))
    s = res.summary
    assert res.extra["elastic_instances"] == 4
    assert s["lost_groups"] == 0 and s["duplicated_groups"] == 0 and s["c1_violations"] == 0
    assert s["c3_violations"] == 0 and not res.extra["deadlock"]
    assert_sim_checks_clean(res)
    # the trainer's devices joined the pool (loaded weights) while it waited, and left for training
    states = {state for iid, _, _, _, state in res.timeline if iid.startswith("e")}
    assert {"switching", "paused"} <= states


def test_orchestrator_section_is_loaded_strictly():
    with pytest.raises(ConfigError, match="orchestrator.max_stalenes"):
        load_sim_config(TINY, ["orchestrator.max_stalenes=3"])
    with pytest.raises(ConfigError, match="cost.decode_weight_read_s"):
        load_sim_config(TINY, ["cost.decode_weight_read_s=-1"])


@pytest.mark.slow
def test_orchestrator_state_stays_bounded_over_a_long_run():
    """Consumed groups leave the orchestrator (their record is consumed.jsonl): what a checkpoint
    holds of it after 320 steps is about what it holds after 20, not 16x (issue A1)."""
    short = simulate(load_sim_config(TINY, ["sim.steps=20"], mode="dora"))
    long = simulate(load_sim_config(TINY, ["sim.steps=320"], mode="dora"))
    assert long.summary["consumed_groups"] == 320 * long.summary["tbs"]
    assert long.summary["lost_groups"] == 0 and long.summary["duplicated_groups"] == 0
    assert_sim_checks_clean(long)
    small, big = short.extra["orchestrator_state_bytes"], long.extra["orchestrator_state_bytes"]
    assert small > 0
    assert big <= 1.5 * small, (small, big)


def test_rebalance_overhead_delays_the_switches_a_rebalance_orders():
    """cost.rebalance_overhead_s is a rebalance's fixed control-plane cost: every version switch
    (in dora, all come from rebalances) keeps its instance switching that much longer."""
    def switch_spans(overhead):
        res = simulate(_cfg("dora", f"cost.rebalance_overhead_s={overhead}"))
        end = res.extra["virtual_time_s"]
        spans = [b - a for _, a, b, _, st in res.timeline if st == "switching" and b < end]
        assert spans and res.extra["orchestrator_rebalances"] > 0
        return res, spans

    cost = _cfg("dora").cost
    base, plain = switch_spans(0.0)
    slow, delayed = switch_spans(7.0)
    assert min(plain) == pytest.approx(cost.weight_sync_s())
    assert min(delayed) == pytest.approx(cost.weight_sync_s() + 7.0)
    assert slow.extra["switch_instance_s"] > base.extra["switch_instance_s"]


def test_host_kv_tier_lifts_a_kv_bound_rollout():
    """With device KV for ~5 requests per instance (cap 16), the host tier admits more requests
    instead of queueing them: utilization rises, and throughput with it when the host link hides
    the spilled KV's stream; a slow link makes every step pay for the spill."""
    kv_bound = ["cost.kv_capacity_tokens=8000"]
    off = simulate(_cfg("dora", *kv_bound))
    fast = simulate(_cfg("dora", *kv_bound, "cost.host_kv_capacity_tokens=40000", "cost.host_kv_bandwidth_Bps=1e12"))
    slow = simulate(_cfg("dora", *kv_bound, "cost.host_kv_capacity_tokens=40000", "cost.host_kv_bandwidth_Bps=1e9"))
    for r in (off, fast, slow):
        assert r.summary["lost_groups"] == 0 and r.summary["c1_violations"] == 0 and not r.extra["deadlock"]
        assert_sim_checks_clean(r)
    assert fast.summary["rollout_utilization"] > 1.2 * off.summary["rollout_utilization"]
    assert fast.summary["throughput_tokens_per_s"] > 1.2 * off.summary["throughput_tokens_per_s"]
    assert slow.summary["throughput_tokens_per_s"] < off.summary["throughput_tokens_per_s"]
def _per_step(spans, ends):
    """Seconds of ``spans`` inside each step's interval (previous step's end, this step's end]."""
    out, prev = [], 0.0
    for end in ends:
        out.append(sum(max(0.0, min(b, end) - max(a, prev)) for a, b in spans))
        prev = end
    return out


@pytest.mark.parametrize("mode", ["dora", "one_step_off"])
def test_weight_sync_metrics_agree_with_the_instance_timelines(mode):
    """The instances' own timelines (switching segments) are the independent record: per step, the
    instance-seconds spent loading weights; over the window, their share of instance-time. sync_s
    is the trainer's push (disaggregated placement); rebalancing is measured where a rebalancer runs."""
    cfg = _cfg(mode, "sim.timeline=true")
    sim = Simulation(cfg)
    res = sim.run()
    ends = res.series["end_s"]
    loads = [(a, b) for inst in sim.instances.values() for a, b, _, state in inst.intervals if state == "switching"]
    expected = _per_step(loads, ends)
    assert sum(1 for x in expected if x > 0) >= 2
    assert [r["perf/weight_sync_time_s"] for r in res.steps] == pytest.approx(expected)
    assert [r["perf/sync_time_s"] for r in res.steps] == pytest.approx([cfg.cost.trainer_push_s] * len(ends))
    # window: the steps after the warm-up one; every rollout instance is in the pool all along
    instance_s = len(sim.rollout_ids) * (ends[-1] - ends[0])
    assert res.summary["weight_sync_fraction"] == pytest.approx(sum(expected[1:]) / instance_s)
    if mode == "dora":
        assert 0 < res.summary["rebalance_fraction"] <= res.summary["weight_sync_fraction"]
    else:
        assert res.summary["rebalance_fraction"] is None


@pytest.mark.parametrize("mode,extra", [("partial", []), ("dora", ["cluster.elastic_colocation=true"]),
                                        ("dora", ["workload.turns.kind=point", "workload.turns.value=3"])])
def test_the_simulator_reaches_the_orchestrator_only_through_the_runtimes_event_mapping(mode, extra):
    """The simulator feeds the runtime's event dataclasses through the runtime's own mapping
    (events/mapping.py::EventMapping): no orchestrator event method is called from anywhere else,
    across re-tagged partial requests, elastic leaves and joins, stats, migrations and the turns of
    multi-turn trajectories."""
    from dora_megatron.orchestrator import Orchestrator
    from tests.helpers.orchestrator_spy import CallerCheckingOrchestrator

    sim = Simulation(_cfg(mode, *extra), orchestrator_factory=lambda c, ids: CallerCheckingOrchestrator(Orchestrator(c, ids)))
    res = sim.run()
    assert_run_invariants(sim, res, steps=6)
    callers = sim.orch.callers
    assert {"start", "on_sample_finished", "on_sample_versions", "on_tick", "on_switch_done",
            "on_step_finished", "set_prompt_tokens"} <= set(callers)
    if mode == "partial":
        assert "on_sample_progress" in callers and res.summary["c1_violations"] > 0  # re-tagged requests seen
    elif extra[0].startswith("workload.turns"):
        assert {"on_turn_ended", "on_turn_ready"} <= set(callers)
    else:
        assert {"on_instance_failed", "on_instance_joined"} <= set(callers)  # the elastic instances came and went
    assert {c.split(".")[0] for cs in callers.values() for c in cs} == {"EventMapping"}, callers


#: three turns per trajectory, a long-tailed tool between two turns, 50 tokens of tool result each
MULTI_TURN = ["workload.turns.kind=point", "workload.turns.value=3", "workload.tool_latency_s.kind=lognormal",
              "workload.tool_latency_s.median=2", "workload.tool_latency_s.sigma=1", "workload.tool_result_tokens=50"]


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora", "dora_elastic"])
def test_multi_turn_trajectories_are_consumed_exactly_once_in_exact_batches(mode):
    """A trajectory leaves its instance at every tool call and comes back; groups are still
    consumed once, TBS at a time, and C1 holds in every mode (partial mode runs an interrupted
    trajectory again from its prompt instead of resuming it on new weights)."""
    extra = list(MULTI_TURN)
    if mode == "dora_elastic":
        mode, extra = "dora", extra + ["cluster.elastic_colocation=true"]
    sim = Simulation(_cfg(mode, *extra))
    res = sim.run()
    assert_run_invariants(sim, res, steps=6)
    s = res.summary
    assert s["c1_violations"] == 0
    assert 2.0 < s["turns_per_trajectory_mean"] <= 3.0  # 3, fewer only for responses under 3 tokens
    assert s["tool_use_rate"] > 0.9 and s["tool_latency_s_mean"] > 0
    counted = sum(r.trajectories.get("trajectories", 0) for r in sim.metrics.rows)
    assert 0 < counted <= len(sim.finished_ids)  # each finished trajectory once, in the step it ended in
    assert any(r["env/turns_per_trajectory"] is not None for r in res.steps)
    trained = sum(g.spec.total_tokens for g in sim.groups.values() if g.consumed)
    assert trained > sum(g.spec.prompt_tokens * len(g.sample_ids) + sum(g.spec.response_tokens)
                         for g in sim.groups.values() if g.consumed)  # the tools' results are trained too


def test_a_trajectory_holds_no_slot_while_its_tool_runs():
    """Tools of 1,000 s between two turns: the run lasts many thousands of seconds, the instances
    decode for a few hundred of them; a slot held through the tool would read as busy."""
    res = simulate(_cfg("dora", "workload.turns.kind=point", "workload.turns.value=2",
                        "workload.tool_latency_s.kind=point", "workload.tool_latency_s.value=1000"))
    single = simulate(_cfg("dora"))
    assert res.summary["wall_time_s"] > 3000
    assert res.summary["rollout_utilization"] < single.summary["rollout_utilization"] / 3


class _LoadCheckingSimulation(Simulation):
    """Compares, once every event's consequences are applied, the orchestrator's view of each
    instance with the requests the simulated instance holds (running, queued or arriving), and
    records each next turn: placed on its last turn's instance or not, and the tokens it re-prefilled."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mismatches: list[tuple[float, str, set, set]] = []
        self.next_turns: list[tuple[bool, int]] = []

    def _drain(self):
        super()._drain()
        for iid, oinst in self.orch.instances.items():
            held = {sid for sid, w in self.where.items() if w == iid}
            held |= {sid for sid, (_, dst) in self.transit.items() if dst == iid}
            if set(oinst.samples) != held:
                self.mismatches.append((self.q.now, iid, set(oinst.samples), held))

    def _next_turn(self, a, inst):
        moved = a.instance != self.tooling[a.sample_id][1]
        before = self.sim_reprefill_tokens
        super()._next_turn(a, inst)
        self.next_turns.append((moved, self.sim_reprefill_tokens - before))


@pytest.mark.parametrize("mode", ["sync", "dora"])
def test_between_turns_the_slot_is_the_orchestrators_and_a_move_re_prefills(mode):
    """A turn's end reaches the orchestrator (TurnEnded): from then on it counts the trajectory on
    no instance (the slot is its to give away). The next turn (TurnReady) goes where the
    orchestrator puts it; one put on another instance than its last turn's is a counted move and
    re-prefills its context there, one put back re-prefills nothing (its prefix is cached)."""
    sim = _LoadCheckingSimulation(_cfg(mode, *MULTI_TURN))
    res = sim.run()
    assert_run_invariants(sim, res, steps=6)
    assert sim.mismatches == []
    moved = [tokens for m, tokens in sim.next_turns if m]
    stayed = [tokens for m, tokens in sim.next_turns if not m]
    assert stayed and all(t == 0 for t in stayed)
    assert all(t > 0 for t in moved)
    assert sim.orch.counters.workflow_turn_moves == len(moved)
    if mode == "dora":
        assert moved  # a rebalance gives a waiting trajectory's instance to another version


@pytest.mark.parametrize("mode,config", [("sync", TINY), ("dora", TWO_INSTANCES)])
def test_plot_series_agree_with_the_groups_trained_and_the_config(mode, config):
    """The plots' series (a view of the recorder's step records and the sim's per-step extras,
    sim/report.py::series_of) against independent quantities: each step's response lengths from
    the groups it trained (the simulator's group store, looked up by the ids the batch released),
    its staleness from the released versions, its sync from the cost model, and its step time,
    wait and live versions from the recorder's own steps.jsonl scalars. Two rollout instances at
    S = 3 (dora) train batches that mix versions, so a mean staleness is not any one group's."""
    cfg = load_sim_config(config, FAST, mode=mode)
    sim = Simulation(cfg)
    res = sim.run()
    s, records = res.series, sim.metrics.rows
    assert s["step"] == list(range(6))
    if mode == "dora":
        assert any(len(set(rec.versions)) > 1 for rec in records)
    for k, rec in enumerate(records):
        lengths = [n for g in rec.groups for n in sim.groups[g].spec.response_tokens]
        assert s["max_response_tokens"][k] == max(lengths)
        assert s["mean_response_tokens"][k] == pytest.approx(sum(lengths) / len(lengths))
        assert s["mean_staleness"][k] == pytest.approx(sum(k - v for v in rec.versions) / len(rec.versions))
    sync_s = 2 * cfg.cost.colocated_switch_s if mode == "sync" else cfg.cost.trainer_push_s
    assert s["weight_sync_s"] == [sync_s] * 6
    assert s["step_time_s"] == [r["perf/step_time_s"] for r in res.steps]
    assert s["wait_s"] == [r["perf/wait_time_s"] for r in res.steps]
    assert s["live_versions"] == [r["versions/live"] for r in res.steps]
    assert sum(s["step_time_s"]) == pytest.approx(res.summary["wall_time_s"])
    assert res.extra["mean_response_tokens"] == pytest.approx(sum(s["mean_response_tokens"]) / 6)
