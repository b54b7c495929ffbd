"""Journal replay on resume: finished samples the journal recorded after the checkpoint are filled
back into their records instead of being generated again.

WHY a component of its own: it holds the journal's samples not yet matched to a dispatched group
and decides, per sample, whether a journal entry may stand for it (same group, version and prompt:
C1 holds for a replayed sample as for a generated one), DESIGN section 5.5. The records stay the
executor's (:class:`~dora_megatron.controller.runtime.Runtime`).
"""

from __future__ import annotations

import logging
from array import array
from typing import TYPE_CHECKING

from dora_megatron.comm.batch_files import compact_routed
from dora_megatron.comm.routed_spool import SpooledRouted
from dora_megatron.controller.records import SampleRecord

if TYPE_CHECKING:
    from dora_megatron.controller.journal import Journal, JournaledSample
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.orchestrator import Orchestrator

log = logging.getLogger(__name__)


class JournalReplay:
    """Samples of ``read_journal`` restorable on resume. ``store``: the records they fill (its spool
    holds a journaled sample's routed experts); ``orch``: a group's version is its; ``journal``: where
    a replayed sample is recorded again (None: no journal; a workflow's trajectories are never
    journaled, so there is nothing of them to replay)."""

    def __init__(self, *, store: SampleStore, orch: Orchestrator, journal: Journal | None) -> None:
        self.store = store
        self.orch = orch
        self.journal = journal
        self._pending: dict[str, JournaledSample] = {}  # sample id -> JournaledSample, restorable on resume
        self.samples_from_journal = 0

    def load(self, samples: dict[str, JournaledSample]) -> None:
        """After the executor's ``load_state_dict``: finished samples the journal recorded after the checkpoint
        (:func:`~dora_megatron.controller.journal.read_journal`). Those of restored groups are filled
        in now, those of groups dispatched again later when they are (same id, version, prompt).
        One whose routed experts the spool no longer has (a crash before their write reached the
        file) is not restored: it is generated again."""
        self._pending = {}
        spool = self.store.routed_spool
        for sid, j in samples.items():
            if isinstance(j.routed_experts, SpooledRouted):
                problem = (spool.adopt(j.routed_experts) if spool is not None
                           else "this run has no spool (it writes no batch files)")
                if problem is not None:
                    log.warning("journal sample %s is generated again: its routed experts cannot be read back: %s",
                                sid, problem)
                    continue
            self._pending[sid] = j
        for gid in list(self.store.groups):
            self.restore(gid)

    def restore(self, group_id: str) -> None:
        """Fill in the samples of ``group_id`` (restored, or dispatched again) the journal holds; one
        that cannot stand for its sample is dropped (its spooled routed experts with it)."""
        if not self._pending:
            return
        group = self.store.groups[group_id]
        version = self.orch.groups[group_id].version
        for sid in group.sample_ids:
            j = self._pending.pop(sid, None)
            if j is None:
                continue
            rec = self.store.samples[sid]
            if (rec.finished or j.group_id != group_id or j.version != version
                    or j.prompt_index != group.prompt.index or rec.version != j.version):
                self.drop(j)
                continue
            rec.response_ids, rec.rollout_logprobs = array("i", j.response_ids), array("f", j.rollout_logprobs)
            rec.reward, rec.versions = j.reward, {j.version}
            rec.routed_experts = (j.routed_experts if isinstance(j.routed_experts, SpooledRouted)
                                  else compact_routed(j.routed_experts))
            rec.finish_reason, rec.reward_error = j.finish_reason, j.reward_error
            rec.finished = rec.replay_pending = True

    def drop(self, j: JournaledSample) -> None:
        """A journal sample that stands for none: the spool no longer holds its routed experts for it."""
        spool = self.store.routed_spool
        if spool is not None and isinstance(j.routed_experts, SpooledRouted):
            spool.retire([j.routed_experts])

    def replayed(self, sample_id: str) -> int | None:
        """Loop (:class:`Replayed`): the orchestrator asked to run a sample the journal restored: it
        is finished already. Returns its length, None when it was reported before."""
        rec = self.store.samples[sample_id]
        if not rec.replay_pending:
            return None
        rec.replay_pending = False
        self.samples_from_journal += 1
        if self.journal is not None:  # still finished after this lineage's checkpoint
            js = self.journaled(rec)
            self.journal.sample(js, sorted(rec.versions), replayed=True)
            self.journal.replayed(js)
        return len(rec.response_ids)

    def journaled(self, rec: SampleRecord) -> JournaledSample:
        """``rec`` as the journal records it (:class:`~dora_megatron.controller.journal.JournaledSample`):
        its own arrays, which the journal's writer thread encodes (nothing proportional to its tokens
        on the loop)."""
        from dora_megatron.controller.journal import JournaledSample

        if rec.reward is None:  # journaled once finished, and a finished sample is scored
            raise ValueError(f"sample {rec.sample_id} has no reward: a sample is journaled after its reward")
        return JournaledSample(rec.sample_id, rec.group_id, rec.version, self.store.groups[rec.group_id].prompt.index,
                               rec.response_ids, rec.rollout_logprobs, float(rec.reward), rec.routed_experts,
                               rec.finish_reason, rec.reward_error)
