"""The two rules that make C2 (exactly-once) and C3 (bounded staleness) compatible: admission and
batch formation (DESIGN section 2), as pure functions.

WHY pure: the off-by-one of S is where such systems go wrong, so the rules are written once, with
their derivation, tested on their own, and called by every mode.

Derivation. A group of version ``w`` can only be trained in steps ``t`` with ``w <= t <= w + S``
(it exists once weights ``w`` exist, and C3). So all groups of versions ``<= v`` must fit into the
batches ``B_0 .. B_{v+S}``, whose capacity is ``(v + S + 1) * TBS`` groups: that is the admission
rule. When batches ``B_0 .. B_{t-1}`` already took groups *newer* than ``v``, that capacity shrinks
by those groups; for a dispatch at the newest version no newer group exists, so the two forms
coincide, and only tier-2 legacy fill needs the stricter form (:func:`legacy_admits`).

Batch formation then keeps the invariant ``U_<=v <= (v + S + 1 - t) * TBS`` (``U``: unconsumed
groups, ``t``: next step) for every version: ``B_t`` must hold at least
``need_v = U_<=v - (v + S - t) * TBS`` groups of versions ``<= v``. For ``v = t - S`` this is "every
group of version t-S" (DESIGN); for newer ``v`` it is what keeps later batches feasible. If the
finished groups cannot meet every ``need_v`` the trainer waits.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence


def admits(version: int, dispatched_le_version: int, outstanding: int, max_staleness: int, tbs: int,
           rbs: int) -> bool:
    """DESIGN section 2 admission rule for tagging one new group with ``version``.

    ``dispatched_le_version``: groups ever dispatched with version ``<= version``;
    ``outstanding``: groups dispatched but not yet consumed. True iff
    ``dispatched_le_version + 1 <= (version + S + 1) * TBS`` and ``outstanding + 1 <= RBS``.
    """
    return (dispatched_le_version + 1 <= (version + max_staleness + 1) * tbs
            and outstanding + 1 <= rbs)


def legacy_admits(version: int, newest: int, dispatched: Mapping[int, int], consumed: Mapping[int, int],
                  outstanding: int, max_staleness: int, tbs: int, rbs: int) -> bool:
    """Admission for a *legacy* version (tier-2 fill): the rule must hold for every ``v`` in
    ``[version, newest]`` with the capacity already used by consumed groups newer than ``v``
    subtracted. ``dispatched``/``consumed``: groups per version (all versions ever seen)."""
    if outstanding + 1 > rbs:
        return False
    d_le = sum(n for w, n in dispatched.items() if w <= version)
    c_gt = sum(n for w, n in consumed.items() if w > version)
    for v in range(version, newest + 1):
        if v > version:
            d_le += dispatched.get(v, 0)
            c_gt -= consumed.get(v, 0)
        if d_le + c_gt + 1 > (v + max_staleness + 1) * tbs:
            return False
    return True


def batch_needs(step: int, max_staleness: int, tbs: int, unconsumed: Mapping[int, int]) -> dict[int, int]:
    """Minimum number of groups of versions ``<= v`` that ``B_step`` must contain, per version ``v``
    that has unconsumed groups (only positive needs are returned)."""
    needs: dict[int, int] = {}
    cum = 0
    for v in sorted(unconsumed):
        cum += unconsumed[v]
        need = cum - (v + max_staleness - step) * tbs
        if need > 0:
            needs[v] = need
    return needs


def select_batch(step: int, max_staleness: int, tbs: int, finished: Mapping[int, Collection[str]],
                 unconsumed: Mapping[int, int]) -> list[str] | None:
    """Form ``B_step`` or return None (the trainer must wait).

    ``finished[v]``: complete, unconsumed group ids of version ``v`` in arrival order;
    ``unconsumed[v]``: dispatched-but-unconsumed groups of version ``v`` (finished or not).
    Takes finished groups oldest version first, exactly ``tbs`` of them, only versions with
    ``step - v <= S``, and only if every :func:`batch_needs` bound is met.
    """
    avail = 0
    for v, ids in finished.items():  # early exit, O(versions): not enough eligible groups
        if 0 <= step - v <= max_staleness:
            avail += len(ids)
    if avail < tbs:
        return None
    chosen: list[str] = []
    taken_le: dict[int, int] = {}
    for v in sorted(finished):
        if step - v > max_staleness:
            continue  # never eligible (cannot happen while the invariant holds)
        if v > step:
            break
        for gid in finished[v]:
            if len(chosen) == tbs:
                break
            chosen.append(gid)
        taken_le[v] = len(chosen)
    if len(chosen) < tbs:
        return None
    last = 0
    for v in sorted(set(taken_le) | set(unconsumed)):
        last = taken_le.get(v, last)
        taken_le[v] = last
    for v, need in batch_needs(step, max_staleness, tbs, unconsumed).items():
        if taken_le.get(v, 0) < need:
            return None
    return chosen
