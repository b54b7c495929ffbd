"""The orchestrator's checkpoint: its records and counters as a JSON-able dict, and back.

WHY only records: the lookup tables are rebuilt from the records on restore
(:meth:`~.index.PoolIndex.rebuild`, the function the consistency test checks), so a checkpoint
cannot carry tables that disagree with its records. One format; a 0.1 project keeps no reader of
older ones.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from dora_megatron.orchestrator.host import RuleHost
from dora_megatron.orchestrator.index import PoolIndex
from dora_megatron.types import PENDING, WAITING, Group, Instance, Sample

# 3: the counter duplicated_groups is named duplicate_releases (2: consumed groups are not in the
# snapshot, per-version counts are; 1: every group ever made)
SNAPSHOT_FORMAT = 3
# The snapshot reads the records' fields directly (what ``dataclasses.asdict`` gives, at a fraction
# of its cost: asdict deep-copies field by field, ~0.5 s for the 4,096 instances and 16k samples of
# a large pool, all in the one loop turn of a checkpoint). Every field is an immutable value except
# the two containers, which the snapshot copies (``Group.sample_ids``, ``Instance.samples``).
_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(Group))
_INSTANCE_FIELDS = tuple(f.name for f in dataclasses.fields(Instance))
_sample_values = operator.attrgetter(*_SAMPLE_FIELDS)
_group_values = operator.attrgetter(*_GROUP_FIELDS)
_instance_values = operator.attrgetter(*_INSTANCE_FIELDS)


def snapshot(o: RuleHost) -> dict[str, Any]:
    """The full state of ``o`` as a JSON-able dict; O(outstanding work + live versions)."""
    ix = o.index
    return {
        "format": SNAPSHOT_FORMAT,
        "newest": o.newest, "next_step": o.next_step, "trainer_busy": o.trainer_busy,
        "now": o.now, "group_seq": o._group_seq, "cap_after": o._cap_after,
        "last_rebalance": o._last_rebalance, "last_kv_rebalance": o._last_kv_rebalance,
        "counters": {**dataclasses.asdict(o.counters),
                     "staleness_histogram": {str(k): v for k, v in o.counters.staleness_histogram.items()}},
        "dispatched_by_version": {str(v): n for v, n in ix.dispatched.items()},
        "consumed_by_version": {str(v): n for v, n in ix.consumed.items()},
        "groups": [{**dict(zip(_GROUP_FIELDS, _group_values(g))), "sample_ids": list(g.sample_ids)}
                   for g in o.groups.values()],
        "samples": [dict(zip(_SAMPLE_FIELDS, _sample_values(s))) for s in o.samples.values()],
        "instances": [{**dict(zip(_INSTANCE_FIELDS, _instance_values(i))), "samples": sorted(i.samples)}
                      for i in o.instances.values()],
        "finished_order": {str(v): list(d) for v, d in ix.finished_groups.items()},
        "pending_order": {str(v): list(d) for v, d in ix.pending.items()},
    }


def restore_into(o: RuleHost, snap: dict[str, Any]) -> None:
    """Fill ``o`` (fresh, with no instance) from :func:`snapshot` output (after a JSON round trip)."""
    fmt = snap.get("format")
    if fmt != SNAPSHOT_FORMAT:
        raise ValueError(f"orchestrator snapshot format {fmt!r} is not supported "
                         f"(this version reads format {SNAPSHOT_FORMAT} only)")
    o.newest, o.next_step = snap["newest"], snap["next_step"]
    o.trainer_busy, o.now = snap["trainer_busy"], snap["now"]
    o._group_seq = snap["group_seq"]
    o._set_cap_phase(bool(snap["cap_after"]))
    o._last_rebalance = snap["last_rebalance"]
    o._last_kv_rebalance = snap["last_kv_rebalance"]
    cd = dict(snap["counters"])
    cd["staleness_histogram"] = {int(k): v for k, v in cd["staleness_histogram"].items()}
    o.counters = type(o.counters)(**cd)
    for gd in snap["groups"]:  # outstanding ones only: a consumed group is forgotten at its release
        g = Group(**gd)
        o.groups[g.group_id] = g
    for sd in snap["samples"]:
        s = Sample(**sd)
        o.samples[s.sample_id] = s
    pending_order = {int(v): list(ids) for v, ids in snap["pending_order"].items()}
    for s in o.samples.values():
        if s.state == WAITING:  # its trajectory lived in the process that wrote the snapshot: run it again
            s.turn_from = None
            s.state = PENDING
    for idd in snap["instances"]:
        inst = Instance(**{**idd, "samples": set(idd["samples"])})
        o.instances[inst.instance_id] = inst
    o.index = PoolIndex.rebuild(
        o.instances, o.samples, o.groups, o.index.cap,
        {int(v): n for v, n in snap["dispatched_by_version"].items()},
        {int(v): n for v, n in snap["consumed_by_version"].items()},
        {int(v): ids for v, ids in snap["finished_order"].items()}, pending_order)
