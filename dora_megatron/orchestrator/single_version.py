"""The rules of the modes without the rebalancer (``sync``, ``one_step_off``, ``partial``, and
``dora`` with ``repartition=False``): instances follow the newest version as they drain, queued
work of a version nobody holds gets an idle instance back, and ``partial`` interrupts everything
at a weight update.

WHY a module of its own: these rules and the dora rebalancer (:mod:`.rebalance`) are the two
ways the pool changes version; :meth:`~.core.Orchestrator._fill` runs exactly one of them. Like
the rebalancer they change placements through the orchestrator's
:class:`~.index.PoolIndex` and emit through the orchestrator.
"""

from __future__ import annotations

from dora_megatron.orchestrator.actions import Interrupt
from dora_megatron.orchestrator.host import RuleHost


def follow_newest(o: RuleHost) -> None:
    """A drained instance on an older version loads the newest one, unless its version still
    has queued requests."""
    ix = o.index
    for v in [v for v in ix.active if v != o.newest]:
        if ix.pending.get(v):
            continue
        for iid in sorted(ix.active[v]):
            inst = o.instances[iid]
            if not inst.samples:
                o._switch(inst, o.newest)


def ensure_instances_for_pending(o: RuleHost) -> None:
    """Queued requests of a version no instance holds (after a failure) get an idle instance
    switched back to that version from its snapshot."""
    ix = o.index
    for v in sorted(ix.pending):
        v_dest = o.newest if o.policy.interrupt else v
        if not ix.pending[v] or ix.served(v_dest):
            continue
        idle = [i for i in o.instances.values() if i.alive and not i.samples and not i.switching]
        if not idle:
            return
        o._switch(min(idle, key=lambda i: i.instance_id), v_dest)


def interrupt_all(o: RuleHost) -> None:
    """Partial mode at a weight update: interrupt every in-flight request (partial output kept
    by the driver), switch every instance to the newest version; the requests are resubmitted
    (prompt + partial, re-prefill) as instances come back."""
    ix = o.index
    for iid in sorted(o.instances):
        inst = o.instances[iid]
        if not inst.alive:
            continue
        for sid in sorted(inst.samples):
            s = o.samples[sid]
            ix.unassign(s)
            ix.queue(s)
            o.counters.interrupts += 1
            o._out.append(Interrupt(sid, iid))
        if inst.version != o.newest or inst.switching:
            if inst.target != o.newest:
                o._switch(inst, o.newest)
