"""Admission and batch-formation rules (DESIGN section 2), including the off-by-one of S."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dora_megatron.orchestrator.rules import admits, batch_needs, legacy_admits, select_batch


def test_admission_counts_batches_0_to_v_plus_s():
    # S=0, TBS=4: version 0 may have exactly 4 groups (B_0 only).
    assert admits(0, 3, 3, 0, 4, 100)
    assert not admits(0, 4, 4, 0, 4, 100)
    # S=2: versions <= 1 fit into B_0..B_3 -> 16 groups.
    assert admits(1, 15, 0, 2, 4, 100)
    assert not admits(1, 16, 0, 2, 4, 100)


def test_admission_respects_rbs():
    assert admits(0, 0, 7, 3, 4, 8)
    assert not admits(0, 0, 8, 3, 4, 8)


def test_legacy_admission_subtracts_capacity_taken_by_newer_groups():
    # S=1, TBS=2. v0: 3 groups dispatched; B_0 took one v0 group; B_1 took two v1 groups.
    dispatched = {0: 3, 1: 3}
    consumed = {0: 1, 1: 2}
    # The DESIGN rule alone would allow a 4th v0 group (3 + 1 <= (0+1+1)*2) ...
    assert admits(0, 3, 3, 1, 2, 100)
    # ... but B_0..B_1 are full: 3 + 2 (newer groups consumed) + 1 > 4.
    assert not legacy_admits(0, 2, dispatched, consumed, 3, 1, 2, 100)
    assert legacy_admits(1, 1, {1: 1}, {}, 0, 1, 2, 100)


def test_batch_must_contain_every_group_of_version_t_minus_s():
    # step 2, S=1: every v1 group must be in B_2
    finished = {1: ["a"], 2: ["b", "c"]}
    unconsumed = {1: 2, 2: 2}
    assert select_batch(2, 1, 2, finished, unconsumed) is None  # one v1 group still running
    finished = {1: ["a", "e"], 2: ["b", "c"]}
    assert select_batch(2, 1, 2, finished, unconsumed) == ["a", "e"]


def test_batch_needs_keep_later_batches_feasible():
    # S=2, TBS=1, step 1: three v0 groups were admitted (B_0..B_2), one consumed by B_0.
    # B_1 may not skip v0 entirely, else B_2 would need two v0 groups.
    # need_v0 = 2 - (0+2-1)*1 = 1; need_v1 = 3 - (1+2-1)*1 = 1
    assert batch_needs(1, 2, 1, {0: 2, 1: 1}) == {0: 1, 1: 1}
    assert select_batch(1, 2, 1, {1: ["new"]}, {0: 2, 1: 1}) is None
    assert select_batch(1, 2, 1, {0: ["old"], 1: ["new"]}, {0: 2, 1: 1}) == ["old"]


def test_batch_is_oldest_first_and_exactly_tbs():
    finished = {3: ["x", "y"], 1: ["a"], 2: ["b", "c"]}
    assert select_batch(3, 2, 3, finished, {1: 1, 2: 2, 3: 2}) == ["a", "b", "c"]
    assert select_batch(3, 2, 6, finished, {1: 1, 2: 2, 3: 2}) is None


@settings(max_examples=150, deadline=None)
@given(S=st.integers(0, 4), tbs=st.integers(1, 5), steps=st.integers(1, 12), data=st.data())
def test_rules_never_strand_a_group(S, tbs, steps, data):
    """Admit greedily at the newest version, finish groups in random order, form batches with
    select_batch when possible: no consumed group is ever staler than S, and once every group
    is finished a batch can always be formed (admission + needs are jointly feasible)."""
    dispatched: dict[int, int] = {}
    unconsumed: dict[int, int] = {}
    running: list[tuple[int, int]] = []
    finished: dict[int, list[str]] = {}
    names = iter(range(10**6))
    for step in range(steps):
        newest = step
        total = sum(dispatched.values())
        while admits(newest, total, sum(unconsumed.values()), S, tbs, tbs * (S + 2)):
            dispatched[newest] = dispatched.get(newest, 0) + 1
            unconsumed[newest] = unconsumed.get(newest, 0) + 1
            running.append((newest, next(names)))
            total += 1
        while True:
            batch = select_batch(step, S, tbs, finished, {v: n for v, n in unconsumed.items() if n})
            if batch is not None:
                break
            assert running, "waiting for a batch with nothing running: infeasible"
            v, name = running.pop(data.draw(st.integers(0, len(running) - 1)))
            finished.setdefault(v, []).append(f"{v}:{name}")
        for gid in batch:
            v = int(gid.split(":")[0])
            assert 0 <= step - v <= S
            finished[v].remove(gid)
            unconsumed[v] -= 1
        assert len(batch) == tbs
        assert all(n == 0 for v, n in unconsumed.items() if v < step + 1 - S)
