"""The sample store: the execution data of the outstanding groups (prompts, tokens, logprobs,
rewards) and the hand-off of a released batch to the trainer step.

WHY a component of its own: the orchestrator owns which groups and samples exist, their version
and state (:class:`~dora_megatron.types.Sample`, :class:`~dora_megatron.types.Group`), but it
holds no tokens; the executor needs them to submit, resume, migrate, checkpoint and train. This
store keeps exactly that data and nothing the orchestrator already knows, for the outstanding
groups only: a group's records go once the trainer was handed it (the orchestrator owns which
groups are consumed, ``consumed.jsonl`` records them), so memory is O(outstanding work). The
executor (:class:`~dora_megatron.controller.runtime.Runtime`) maps actions and events onto it.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dora_megatron.comm.batch_files import compact_routed
from dora_megatron.comm.json_value import JSON
from dora_megatron.comm.routed_spool import RoutedSpool, SpoolError, SpooledRouted
from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.controller.records import GroupRecord, SampleRecord, entry_tokens
from dora_megatron.data.codec import TextCodec
from dora_megatron.data.reward_api import RewardInput, RewardResult, reward_input
from dora_megatron.data.tasks import PromptSource
from dora_megatron.events.answer import EngineAnswer
from dora_megatron.orchestrator import Dispatch, ReleaseBatch
from dora_megatron.workflow.runner import WorkflowReply

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

#: the training reward as the store calls it: blocking and thread-safe (called from a worker thread
#: off the loop, or on the loop for an answer that came without one), never raising (a failure is
#: a :class:`RewardResult` with ``error`` set), e.g. a scorer's ``score_sync``
RewardFn = Callable[[RewardInput], RewardResult]


@dataclass(frozen=True)
class ReleasedBatch:
    """What the trainer was handed for one step, kept for its step log."""

    wait_s: float
    rewards: list[float | None]  # a released sample is scored; None only in a record never finished
    lengths: list[int]
    staleness: list[int]
    tokens: int
    group_ids: tuple[str, ...]
    versions: tuple[int, ...]
    reward_errors: int = 0  # samples of the batch whose reward function failed (scored 0)


class SampleStore:
    """The outstanding groups' records: dispatched (:meth:`dispatch`), filled by engine answers
    (:meth:`apply`, :meth:`score`), handed to the trainer (:meth:`take_batch`), checkpointed
    (:meth:`state_entries`, :meth:`load_entries`).

    ``rollout``: the sampling settings of every submission (the config's section itself);
    ``seed``: the run's seed (``run.seed``), drawn into each submission's sampling seed."""

    def __init__(self, source: PromptSource, codec: TextCodec, reward_fn: RewardFn,
                 rollout: RolloutConfig, seed: int, first_prompt: int = 0) -> None:
        self.source = source
        self.codec = codec
        self.reward_fn = reward_fn
        self.rollout = rollout
        self.seed = seed
        self.next_prompt = first_prompt
        self.samples: dict[str, SampleRecord] = {}
        self.groups: dict[str, GroupRecord] = {}
        self.samples_finished = 0  # engine answers that completed a sample (records of consumed groups are gone)
        self.reward_errors = 0  # training samples whose reward function failed, since this process started
        #: where finished samples' routed experts are written as they finish (the trainer client's,
        #: set by the runtime with routing replay and batch files; None: the batch files copy them)
        self.routed_spool: RoutedSpool | None = None

    def dispatch(self, a: Dispatch) -> GroupRecord:
        """The records of a new group: the next prompt, rendered once for all its samples."""
        prompt = self.source.get(self.next_prompt)
        self.next_prompt += 1
        prompt_ids = self.codec.encode_prompt(prompt)
        group = self.groups[a.group_id] = GroupRecord(a.group_id, prompt, tuple(a.sample_ids))
        for i, sid in enumerate(a.sample_ids):
            self.samples[sid] = SampleRecord(sid, a.group_id, i, a.version, list(prompt_ids))
        return group

    def prompt_tokens(self, group_id: str) -> int:
        """The prompt length of a dispatched group (the orchestrator's re-prefill accounting)."""
        return len(self.samples[self.groups[group_id].sample_ids[0]].prompt_ids)

    def siblings(self, rec: SampleRecord) -> list[SampleRecord | None]:
        """The records of ``rec``'s group (None: consumed meanwhile)."""
        return [self.samples.get(s) for s in self.groups[rec.group_id].sample_ids]

    def sampling(self, rec: SampleRecord) -> dict[str, Any]:
        """Sampling parameters of ``rec``'s next submission: the tokens it has left, and a seed of
        the run, the sample and its submission count (a resubmission draws anew)."""
        seed = zlib.crc32(f"{self.seed}/{rec.sample_id}/{rec.submissions}".encode()) & 0x7FFFFFFF
        return {
            "max_new_tokens": max(1, self.rollout.max_new_tokens - len(rec.response_ids)),
            "temperature": self.rollout.temperature, "top_p": self.rollout.top_p, "top_k": self.rollout.top_k,
            "stop_token_ids": list(dict.fromkeys([*self.codec.eos_ids, *self.rollout.stop_token_ids])),
            "sampling_seed": seed,
        }

    @staticmethod
    def apply(rec: SampleRecord, resp: EngineAnswer) -> str | None:
        """Append an engine answer's tokens to ``rec``; returns its finish reason's type ("abort":
        interrupted or failed over, the partial output is kept for a later resubmission).

        An answer that crossed a weight update (SGLang's ``meta_info.weight_versions``) produced
        its tokens under several versions: each is recorded, not just the routed one."""
        arrays = resp.token_arrays  # parsed by comm.generate_codec: a copy of bytes here
        if arrays is not None:
            rec.response_ids.extend(arrays[0])
            rec.rollout_logprobs.extend(arrays[1])
        else:  # an answer built otherwise (a workflow's trajectory, an in-process engine): converted here
            rec.response_ids.extend(resp.output_ids)
            rec.rollout_logprobs.extend(resp.output_token_logprobs or [0.0] * len(resp.output_ids))
        rec.versions.update(int(v) for v in resp.versions_used if str(v).lstrip("-").isdigit())
        reason = (resp.finish_reason or {}).get("type")
        return None if reason is None else str(reason)  # (a string on every engine's answer)

    async def reward_off_loop(self, rec: SampleRecord, resp: EngineAnswer) -> RewardResult | None:
        """The reward of the sample ``resp`` finishes, computed in a worker thread by the task that
        got the answer, before it reports it: a slow reward function (a checker, a sandbox) then
        never holds the loop. None: ``resp`` does not finish the sample, or carries its own reward
        (a workflow's), or the sample is gone. Scores exactly what :meth:`score` would: the model's
        tokens of the whole output once ``resp`` is appended."""
        workflow = resp if isinstance(resp, WorkflowReply) else None  # a trajectory: its own mask and reward
        if (rec.sample_id not in self.samples or resp.migrated
                or (resp.finish_reason or {}).get("type") == "abort" or (workflow is not None and workflow.reward is not None)):
            return None
        # the output so far copied here (a memcpy: the loop appends the answer only after this
        # returns, but the copy owns no state); joining it with the answer and detokenizing it,
        # proportional to its tokens, in the worker thread with the reward
        done, mask = array("i", rec.response_ids), workflow.loss_mask if workflow is not None else None
        mask = list(mask) if mask is not None else rec.loss_mask
        return await asyncio.to_thread(self._reward_of, rec, done, resp.output_ids, mask)

    def _reward_of(self, rec: SampleRecord, done: array[int], new: Sequence[int], mask: list[int] | None) -> RewardResult:
        done.extend(new)
        return self.reward_fn(self.reward_input(rec, done.tolist(), mask))

    def keep_routed(self, rec: SampleRecord, routed: np.ndarray | None) -> None:
        """``rec`` finished with these routed experts (a compact array, or None). With a spool they
        are queued to it (:mod:`~dora_megatron.comm.routed_spool`: written in its thread while the
        rollout goes on, so that the step's hand-off does not write them) and ``rec`` keeps only
        where they will be: the controller's memory, its checkpoints and its journal then hold a
        location, not ids proportional to the tokens. An earlier answer's spooled ids are dropped."""
        spool = self.routed_spool
        if spool is not None and isinstance(rec.routed_experts, SpooledRouted):
            spool.retire([rec.routed_experts])
        rec.routed_experts = spool.put(routed) if spool is not None and routed is not None else routed

    def restore_routed(self, rec: SampleRecord, value: JSON, spooled: JSON, where: str) -> str | None:
        """Resume: ``rec``'s routed experts as a checkpoint or the journal recorded them (``value``:
        the ids as SGLang's text or a list; ``spooled``: a ``routed_at`` location). A location is
        held again by the spool if its ids are there; returns why not (None: restored)."""
        if spooled is None:
            rec.routed_experts = compact_routed(value)
            return None
        ref = SpooledRouted.from_state(spooled, where)
        if self.routed_spool is None:
            return f"they are in the spool ({ref.file}), but this run has none (it writes no batch files)"
        problem = self.routed_spool.adopt(ref)
        if problem is None:
            rec.routed_experts = ref
        return problem

    def reward_input(self, rec: SampleRecord, response_ids: list[int], loss_mask: list[int] | None) -> RewardInput:
        """What the reward sees of ``rec`` finished with ``response_ids``: the model's tokens decoded
        (not a workflow's tool results), and its group's row (ground truth, ``data_source``,
        ``extra_info``) through :func:`~dora_megatron.data.reward_api.reward_input`, the one builder
        the eval rounds and the bench's capacity pass use too."""
        model = response_ids if loss_mask is None else [t for t, m in zip(response_ids, loss_mask) if m]
        return reward_input(self.groups[rec.group_id].prompt, self.codec.decode(model))

    def score(self, rec: SampleRecord, resp: EngineAnswer, reason: str | None, reward: RewardResult | None = None) -> None:
        """``rec`` finished with answer ``resp``: mark it and set its reward (a workflow's own, the
        one :meth:`reward_off_loop` computed, or else the reward function's, here), on the model's
        tokens only, not the tools' results. A failed reward function scores 0 and is counted
        (:attr:`reward_errors`, the step's ``reward/errors``); the first failure's traceback is logged."""
        rec.finished = True
        rec.finish_reason = reason
        self.samples_finished += 1
        workflow = resp if isinstance(resp, WorkflowReply) else None  # a trajectory (rollout.workflow)
        if workflow is not None and workflow.loss_mask is not None:
            if workflow.prompt_ids is None:  # (WorkflowRunner sets both)
                raise ValueError(f"sample {rec.sample_id}: a workflow's trajectory with a loss_mask but no prompt_ids")
            rec.prompt_ids, rec.loss_mask = list(workflow.prompt_ids), list(workflow.loss_mask)
        if workflow is not None and workflow.reward is not None:
            rec.reward = float(workflow.reward)
            return
        result = reward if reward is not None else self.reward_fn(self.reward_input(rec, rec.response_ids.tolist(),
                                                                                     rec.loss_mask))
        rec.reward, rec.reward_error = float(result.score), result.error
        if result.error is not None:
            self.reward_errors += 1
            if self.reward_errors == 1:
                log.warning("reward error on sample %s (reward 0; later ones are counted as reward_errors, not "
                            "logged): %s\n%s", rec.sample_id, result.error, result.traceback or "")

    def take_batch(self, a: ReleaseBatch, wait_s: float,
                   dump: bool) -> tuple[list[TrainSample], ReleasedBatch, list[dict[str, Any]]]:
        """The released groups' samples as the trainer takes them; their records go (consumed now,
        exactly once). Returns the samples, what the step log needs of them, and (``dump``) what the
        rollout dump writes of each."""
        samples, rewards, lengths, staleness, tokens, errors = [], [], [], [], 0, 0
        dumped: list[dict[str, Any]] = []  # what the rollout dump needs of each sample (not sent to the trainer)
        for gid, version in zip(a.group_ids, a.versions):
            group = self.groups.pop(gid, None)
            if group is None:  # the orchestrator never does this (it counts duplicated_groups)
                raise RuntimeError(f"group {gid} released twice (or never dispatched)")
            staleness.append(a.step - version)
            for sid in group.sample_ids:
                rec = self.samples.pop(sid)
                samples.append(TrainSample(rec.prompt_ids, rec.response_ids, rec.rollout_logprobs, version=rec.version,
                                           reward=rec.reward, group_id=gid, loss_mask=rec.loss_mask,
                                           routed_experts=rec.routed_experts))
                if dump:  # JSON lines: lists (a dump shows texts and tokens, not routing)
                    dumped.append({"prompt_ids": rec.prompt_ids, "response_ids": rec.response_ids.tolist(),
                                   "rollout_logprobs": rec.rollout_logprobs.tolist(), "reward": rec.reward,
                                   "group_id": gid, "version": rec.version,
                                   **({"loss_mask": rec.loss_mask} if rec.loss_mask is not None else {}),
                                   "sample_id": sid, "finish_reason": rec.finish_reason,
                                   **({"reward_error": rec.reward_error} if rec.reward_error is not None else {})})
                rewards.append(rec.reward)
                errors += rec.reward_error is not None
                lengths.append(len(rec.response_ids))
                tokens += len(rec.prompt_ids) + len(rec.response_ids)
        batch = ReleasedBatch(wait_s, rewards, lengths, staleness, tokens, tuple(a.group_ids), tuple(a.versions),
                              errors)
        return samples, batch, dumped

    # ------------------------------------------------------------------ checkpoint
    def state_entries(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ``groups`` and ``samples`` entries of ``controller.json``: what the orchestrator
        snapshot does not hold (prompt and output tokens, rewards). A group's prompt ids once (every
        sample of it has the same prompt; a finished workflow sample keeps its workflow's own
        rendering in its entry). Unfinished samples restart from their prompt on their own version
        (C1), so they need no entry; a pending replay is unfinished for the orchestrator.

        A spooled sample's routed experts are its ``routed_at`` location (a ``--resume`` reads them
        back from the spool, :meth:`restore_routed`). A finished sample's token ids, log-probs and
        unspooled routed experts are its own arrays, not lists
        or base64: the cut is one loop turn and must not be proportional to the tokens held (at
        reasoning lengths millions); :mod:`.state_file` encodes them in its writer thread, the
        text a list and SGLang's base64 would give. They can be shared: a finished sample's arrays
        are replaced, never changed in place."""
        groups, samples = [], []
        for g in self.groups.values():  # consumed ones were forgotten at release
            recs = [self.samples[sid] for sid in g.sample_ids]
            groups.append({"group_id": g.group_id, "prompt_index": g.prompt.index,
                           "prompt_ids": next((r.prompt_ids for r in recs if r.loss_mask is None), recs[0].prompt_ids)})
            for r in recs:
                if not r.finished or r.replay_pending:
                    continue
                samples.append({
                    "sample_id": r.sample_id, "reward": r.reward, "response_ids": r.response_ids,
                    **({"reward_error": r.reward_error} if r.reward_error is not None else {}),
                    "rollout_logprobs": r.rollout_logprobs, "versions": sorted(r.versions),
                    **({"routed_at": r.routed_experts.state()} if isinstance(r.routed_experts, SpooledRouted)
                       else {"routed_experts": r.routed_experts} if r.routed_experts is not None else {}),
                    **({"finish_reason": r.finish_reason} if r.finish_reason is not None else {}),
                    **({"prompt_ids": r.prompt_ids, "loss_mask": r.loss_mask} if r.loss_mask is not None else {}),
                })
        return groups, samples

    def load_entries(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_entries` (the caller has checked the file's format). A group's
        version and sample ids, a sample's version: the orchestrator snapshot's, which lists every
        outstanding group and sample."""
        self.next_prompt = int(state["next_prompt"])
        orch_groups = {g["group_id"]: g for g in state["orchestrator"]["groups"]}
        orch_samples = {s["sample_id"]: s for s in state["orchestrator"]["samples"]}
        for i, g in enumerate(state["groups"]):
            og = orch_groups.get(g["group_id"])
            if og is None:
                raise ValueError(f"groups[{i}] (group {g['group_id']}): not in the orchestrator snapshot")
            prompt = self.source.get(int(g["prompt_index"]))
            sample_ids = tuple(og["sample_ids"])
            self.groups[g["group_id"]] = GroupRecord(g["group_id"], prompt, sample_ids)
            for j, sid in enumerate(sample_ids):
                self.samples[sid] = SampleRecord(sid, g["group_id"], j, int(orch_samples[sid]["version"]),
                                                 list(g["prompt_ids"]))
        for i, d in enumerate(state["samples"]):
            rec = self.samples[d["sample_id"]]
            if "prompt_ids" in d:  # a workflow's trajectory: its own rendering of the prompt (with loss_mask)
                rec.prompt_ids = list(d["prompt_ids"])
            ids, logprobs = entry_tokens(d, f"samples[{i}] (sample {d['sample_id']})")
            rec.response_ids, rec.rollout_logprobs = array("i", ids), array("f", logprobs)
            rec.versions, rec.reward, rec.finished = set(d["versions"]), d["reward"], True
            rec.reward_error = d.get("reward_error")
            rec.finish_reason, rec.loss_mask = d.get("finish_reason"), d.get("loss_mask")
            problem = self.restore_routed(rec, d.get("routed_experts"), d.get("routed_at"), f"sample {rec.sample_id}")
            if problem is not None:  # the checkpoint's samples are trained as they were, or not at all
                raise SpoolError(f"cannot resume: sample {rec.sample_id} of the checkpoint: its routed experts "
                                 f"cannot be read back: {problem}")
