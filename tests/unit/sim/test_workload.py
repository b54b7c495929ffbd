"""Workload lengths: deterministic per group index, clipped, drifting, all distribution kinds."""

import statistics

from dora_megatron.config.sim import LengthDistConfig, WorkloadConfig
from dora_megatron.sim.workload import Workload


def test_group_lengths_are_a_function_of_seed_and_index():
    w1, w2 = Workload(WorkloadConfig(seed=3), 8), Workload(WorkloadConfig(seed=3), 8)
    assert [w1.group(i) for i in range(50)] == [w2.group(i) for i in reversed(range(50))][::-1]
    assert Workload(WorkloadConfig(seed=4), 8).group(0) != w1.group(0)


def test_clipping_and_group_size():
    cfg = WorkloadConfig(max_response_tokens=3000, max_prompt_tokens=100, min_response_tokens=5)
    w = Workload(cfg, 16)
    for i in range(300):
        g = w.group(i)
        assert len(g.response_tokens) == 16
        assert all(5 <= n <= 3000 for n in g.response_tokens)
        assert 1 <= g.prompt_tokens <= 100
        assert g.total_tokens == g.prompt_tokens * 16 + sum(g.response_tokens)


def test_lognormal_median_and_long_tail():
    w = Workload(WorkloadConfig(response=LengthDistConfig(median=1000, sigma=1.3), max_response_tokens=10**6), 1)
    xs = [w.group(i).response_tokens[0] for i in range(4000)]
    assert 850 < statistics.median(xs) < 1150
    assert statistics.mean(xs) > 1.5 * statistics.median(xs)


def test_drift_lengthens_later_versions():
    w = Workload(WorkloadConfig(drift_per_step=0.1, max_response_tokens=10**6), 4)
    early = sum(sum(w.group(i, version=0).response_tokens) for i in range(200))
    late = sum(sum(w.group(i, version=10).response_tokens) for i in range(200))
    assert late > 2 * early


def test_group_correlation_makes_groups_homogeneous():
    def within_spread(corr):
        w = Workload(WorkloadConfig(group_correlation=corr, max_response_tokens=10**6), 8)
        return statistics.mean(statistics.pstdev(w.group(i).response_tokens) / statistics.mean(w.group(i).response_tokens)
                               for i in range(300))
    assert within_spread(0.95) < within_spread(0.0)


def test_empirical_and_mixture():
    emp = LengthDistConfig(kind="empirical", bins=[[100, 200, 1.0], [5000, 6000, 0.0]])
    w = Workload(WorkloadConfig(response=emp), 4)
    assert all(100 <= n <= 200 for i in range(100) for n in w.group(i).response_tokens)
    mix = LengthDistConfig(kind="mixture", components=[LengthDistConfig(kind="point", value=10),
                                                       LengthDistConfig(kind="point", value=20000)],
                           weights=[0.5, 0.5])
    w = Workload(WorkloadConfig(response=mix, max_response_tokens=30000), 4)
    seen = {n for i in range(100) for n in w.group(i).response_tokens}
    assert seen == {10, 20000}


def test_multi_turn_splits_the_same_lengths_into_turns_with_a_tool_between():
    single = Workload(WorkloadConfig(seed=5), 8)
    cfg = WorkloadConfig(seed=5, turns=LengthDistConfig(kind="lognormal", median=3, sigma=1), max_turns=6,
                         tool_latency_s=LengthDistConfig(kind="point", value=2.5), tool_result_tokens=7)
    multi = Workload(cfg, 8)
    counts = []
    for i in range(200):
        g, s = multi.group(i), single.group(i)
        assert (g.prompt_tokens, g.response_tokens) == (s.prompt_tokens, s.response_tokens)  # only turns differ
        for n, ends, tools in zip(g.response_tokens, g.turn_ends, g.tool_s):
            assert 1 <= len(ends) <= 6 and ends[-1] == n and list(ends) == sorted(set(ends)) and ends[0] >= 1
            assert tools == (2.5,) * (len(ends) - 1)
            counts.append(len(ends))
        assert g.total_tokens == s.total_tokens + 7 * sum(len(t) for t in g.tool_s)
    assert set(counts) >= {1, 2, 3, 6}  # a spread of turn counts, the tail clipped at max_turns
    assert not single.group(0).turn_ends  # single-turn: no turns recorded
