"""Partition (largest remainder, min-1 rules), hysteresis and move plans (DESIGN section 4)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dora_megatron.orchestrator.partition import largest_remainder, partition, should_apply
from dora_megatron.orchestrator.plan import assign_freed, assign_migrations, choose_to_free, level_within_version


def test_largest_remainder_hand_case():
    # 10 instances, loads 1:2:7 -> quotas 1.0, 2.0, 7.0
    assert largest_remainder(10, {0: 1, 1: 2, 2: 7}) == {0: 1, 1: 2, 2: 7}
    # 4 instances, loads 1:1:1 -> 1.33 each, the one left goes to the newest on a tie
    assert largest_remainder(4, {0: 1, 1: 1, 2: 1}) == {0: 1, 1: 1, 2: 2}


def test_min_one_for_versions_with_work_and_for_the_newest():
    # 8 instances; version 0 has 1 request, the newest version 3 has 999
    out = partition(8, {0: 1, 3: 999}, required={0, 3})
    assert out == {0: 1, 3: 7}


def test_pool_smaller_than_versions_prefers_running_then_oldest():
    out = partition(2, {0: 5, 1: 1, 2: 100}, required={0, 1, 2}, priority=[2])
    assert out[2] >= 1 and out[0] == 1 and out[1] == 0 and sum(out.values()) == 2


@settings(max_examples=200, deadline=None)
@given(pool=st.integers(1, 64),
       demand=st.dictionaries(st.integers(0, 6), st.integers(0, 1000), min_size=1, max_size=5),
       extra=st.sets(st.integers(0, 6), max_size=3))
def test_partition_sums_to_pool_and_honours_minimums(pool, demand, extra):
    required = {v for v, r in demand.items() if r > 0} | extra
    out = partition(pool, demand, required)
    assert sum(out.values()) == pool
    assert all(n >= 0 for n in out.values())
    if len(required) <= pool:
        assert all(out[v] >= 1 for v in required)
    else:
        assert sorted(v for v in required if out[v] >= 1) == sorted(required)[:pool]


def test_hysteresis():
    # balanced enough: 10 req on 2 instances vs 12 req on 2 instances -> keep
    assert not should_apply({0: 2, 1: 2}, {0: 2, 1: 2}, {0: 10, 1: 12}, (), 1.5)
    assert not should_apply({0: 2, 1: 2}, {0: 1, 1: 3}, {0: 10, 1: 14}, (), 1.5)
    # imbalance 2 req/inst vs 10 req/inst -> apply
    assert should_apply({0: 2, 1: 2}, {0: 1, 1: 3}, {0: 4, 1: 20}, (), 1.5)
    # a version with an idle instance gives it up
    assert should_apply({0: 2, 1: 2}, {0: 1, 1: 3}, {0: 1, 1: 2}, {0}, 100.0)
    # a version without any instance gets one (new version / stranded work)
    assert should_apply({0: 4}, {0: 3, 1: 1}, {0: 100, 1: 1}, (), 100.0)
    # a drained version frees its instances
    assert should_apply({0: 1, 1: 3}, {0: 0, 1: 4}, {1: 8}, (), 100.0)


def test_choose_to_free_takes_least_loaded():
    assert choose_to_free({"a": 5, "b": 0, "c": 2, "d": 0}, 3) == ["b", "d", "c"]


def test_migrations_go_to_least_loaded_kept_instance():
    moves = assign_migrations([("s1", "x"), ("s2", "x"), ("s3", "x")], {"k1": 3, "k2": 1})
    assert [m[2] for m in moves] == ["k2", "k2", "k1"]
    assert assign_migrations([("s1", "x")], {}) == []


def test_freed_instances_go_to_newest_growing_version_first():
    assert assign_freed(["a", "b", "c"], {1: 1, 3: 2}) == {"a": 3, "b": 3, "c": 1}


def test_level_within_version():
    assert level_within_version({"hot": 9, "p": 1, "q": 3}, "hot") == ("p", 4)
    assert level_within_version({"hot": 2, "p": 2}, "hot") is None


def _heap_reference(moving, kept):
    import heapq
    heap = [(load, iid) for iid, load in kept.items()]
    heapq.heapify(heap)
    counts = {}
    for _ in moving:
        load, iid = heapq.heappop(heap)
        counts[iid] = counts.get(iid, 0) + 1
        heapq.heappush(heap, (load + 1, iid))
    return counts


@settings(max_examples=200, deadline=None)
@given(kept=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.integers(0, 20), min_size=1, max_size=12),
       m=st.integers(0, 80))
def test_water_filling_matches_least_loaded_one_by_one(kept, m):
    moving = [(f"s{k}", "src") for k in range(m)]
    out = assign_migrations(moving, kept)
    assert [o[0] for o in out] == [s for s, _ in moving]
    counts = {}
    for _, _, dst in out:
        counts[dst] = counts.get(dst, 0) + 1
    assert counts == _heap_reference(moving, kept)


def test_floors_keep_a_shrinking_version_within_the_cap():
    # cap 4: version 0 still runs 20 requests -> needs ceil(20/4) = 5 instances; proportional
    # alone (20 : 300 over 16) would leave it 1
    plain = partition(16, {0: 20, 3: 300}, required={0, 3})
    assert plain[0] < 5
    out = partition(16, {0: 20, 3: 300}, required={0, 3}, floors={0: 5, 3: 75})
    # floors do not all fit (5 + 75 > 16): ignored
    assert out == plain
    out = partition(16, {0: 20, 3: 300}, required={0, 3}, floors={0: 5})
    assert out == {0: 5, 3: 11}


@settings(max_examples=300, deadline=None)
@given(pool=st.integers(1, 64),
       demand=st.dictionaries(st.integers(0, 6), st.integers(0, 1000), min_size=1, max_size=5),
       extra=st.sets(st.integers(0, 6), max_size=3), cap=st.integers(1, 64))
def test_partition_with_floors_keeps_sum_minimums_and_floors_when_they_fit(pool, demand, extra, cap):
    required = {v for v, r in demand.items() if r > 0} | extra
    floors = {v: -(-r // cap) for v, r in demand.items() if r > 0}
    out = partition(pool, demand, required, floors=floors)
    assert sum(out.values()) == pool and all(n >= 0 for n in out.values())
    if len(required) <= pool:
        assert all(out[v] >= 1 for v in required)
    else:
        assert sorted(v for v in required if out[v] >= 1) == sorted(required)[:pool]
    lo = {v: max(floors.get(v, 0), 1 if v in required else 0) for v in out}
    if len(required) <= pool and sum(lo.values()) <= pool:
        assert all(out[v] >= lo[v] for v in out)
    elif sum(lo.values()) > pool or len(required) > pool:
        assert out == partition(pool, demand, required)  # floors ignored when they cannot all fit
