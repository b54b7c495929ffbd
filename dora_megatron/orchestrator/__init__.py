"""The DORA orchestrator: a sans-IO state machine for multi-version streaming rollout
(DESIGN sections 2-4). Stdlib only; no threads, sockets, clock or torch.

WHY sans-IO: the asyncio runtime and the virtual-clock simulator drive the *same* object, so a
decision measured in the simulator is the decision taken in production, and every invariant
(C1-C3, exactly-TBS batches, the staleness window) is property-tested without processes.

Driving contract
----------------
``orch = Orchestrator(config: OrchestratorConfig, instances: list[str])`` - every instance starts
active on version 0; the trainer is idle before step 0. Every event method returns
``list[Action]`` that the driver executes **in order**:

* ``start()`` - call once; returns the first dispatches.
* ``on_tick(now)`` - the driver's clock (seconds); runs the timer-triggered rebalance.
* ``on_sample_progress(sample_id, tokens)`` - optional generated-length report. In ``partial``
  mode it is **not** optional for interrupted work: report the generated length of every
  in-flight sample *before* ``on_step_finished`` (which interrupts them), because a later
  ``Submit`` is a resume (prompt + partial output, re-prefill counted) only when the sample's
  tokens are > 0; a sample whose progress was never reported is resubmitted as a fresh start.
* ``on_sample_finished(sample_id, tokens=None, now=None)`` - a sample is complete.
* ``on_sample_versions(sample_id, versions)`` - the weight versions the engine says produced the
  sample's tokens (report before ``on_sample_finished``); a sample of more than one version is a
  C1 violation, counted at release (``counters.c1_violations``, the only C1 count of a run).
* ``on_instance_stats(instance, running, kv_usage, now=None)`` - engine load; KV over
  ``kv_high_watermark`` levels the instance with its least-loaded peer and triggers a full
  rebalance (dora) at most once per ``kv_rebalance_min_interval_s`` of driver time (``now``, else
  the last time seen by ``on_tick``/``on_sample_finished``).
* ``on_step_finished(version)`` - the trainer finished step ``version - 1`` and the weights
  ``version`` exist (push them to the per-version snapshot before calling).
* ``on_instance_failed(instance)`` / ``on_instance_joined(instance)``.
* ``on_switch_done(instance, version)`` - confirms a ``SwitchVersion``; in dora the new instance
  then takes (``Migrate``) the requests its version's instances hold above the cap.
* ``on_migration_done(sample_id, reprefill_tokens=0)`` - optional; report re-prefill when a
  ``Migrate`` fell back to abort+resubmit.
* ``on_migration_failed(sample_id)`` - a ``Migrate`` could not be done (source died before the
  export, ...): the request is re-queued on its version and comes back as a ``Submit``.
  A ``Submit``/``SwitchVersion`` that fails because the instance died is reported as
  ``on_instance_failed(instance)``: its requests (including ones just submitted or migrated to
  it) are re-queued.
* ``set_prompt_tokens(group_id, n)`` - prompt length, for re-prefill accounting.
* ``poll()`` - re-evaluate without an event.

Actions (frozen dataclasses in :mod:`~dora_megatron.orchestrator.actions`):
``Dispatch(group_id, version, sample_ids)`` (attach a prompt; G samples),
``Submit(sample_id, instance, version, resume)`` (send prompt [+ partial output when
``resume``]; this is abort-and-resubmit after an ``Interrupt`` or a failure),
``Migrate(sample_id, src, dst, version)``, ``Interrupt(sample_id, instance)`` (partial mode),
``SwitchVersion(instance, version, rebalance, keep)`` (``keep``: a dual-version switch, the
instance finishes its requests of version ``keep`` on those weights),
``ReleaseBatch(step, group_ids, versions)`` (the trainer becomes busy with ``step`` until
``on_step_finished(step + 1)``).

Queries: ``sample_status(id)``, ``live_versions()``, ``unfinished_by_version()``,
``instances_by_version()``, ``outstanding``, ``cap()``, ``summary()`` (summary.json counters),
``audit()``; ``snapshot()`` -> JSON-able dict and ``Orchestrator.restore(config, snap)``.
A released group and its samples are forgotten (the driver logs the ``ReleaseBatch``): queries
and the snapshot cover outstanding work only, and late events about them are ignored.

Modes (``config.mode``) are policies of the same machine (:mod:`.policy`): ``sync`` (S=0, one
batch at a time), ``one_step_off`` (S=1, next batch dispatched while the trainer trains),
``partial`` (streaming, interrupt + resubmit at every update; C1 not kept, recorded per sample),
``dora`` (streaming, up to S+1 versions, rebalancer, never interrupts).
"""

from dora_megatron.orchestrator.actions import (Action, ActionHandler, Dispatch, Interrupt, Migrate, ReleaseBatch,
                                                Submit, SwitchVersion, perform)
from dora_megatron.orchestrator.core import Orchestrator
from dora_megatron.orchestrator.host import Counters

__all__ = ["Action", "ActionHandler", "Counters", "Dispatch", "Interrupt", "Migrate", "Orchestrator", "ReleaseBatch",
           "Submit", "SwitchVersion", "perform"]
