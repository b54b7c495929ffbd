"""The asyncio executor that carries out the orchestrator's actions with real engines and a real trainer.

Why one loop around one sans-IO object: every decision (what to dispatch where,
which instance switches, which requests migrate, which groups form a batch) is
made by :class:`~dora_megatron.orchestrator.Orchestrator`; this module only turns
its actions into HTTP calls (asyncio tasks) and puts what happened on the event
queue of :class:`~dora_megatron.controller.loop.ControllerLoop`, which alone feeds
the orchestrator (read :mod:`dora_megatron.controller.loop` first). All of it runs on
the event-loop thread, so the state machine needs no locks.

::

    prompts -> Dispatch ----------> records (prompt ids, seeds)
               Submit   ----------> engine /generate (tagged with its version)   --+
               Migrate  ----------> src /dora/export_request -> dst /dora/import  |  finished
               Interrupt ---------> engine /abort_request (partial output kept)   |  samples
               SwitchVersion -----> engine /update_weights_from_disk (snapshot)   |
               ReleaseBatch ------> trainer /train -> new version snapshot ---+   |
                                                                              |   v
                       on_step_finished(v) <-----------------------------------+  reward,
                       on_sample_finished(id) <------------------------------------+  records

Per-sample ordering: each sample has at most one HTTP operation in flight; a new
operation on a sample (a resubmission after an interrupt, a migration) first
awaits the previous one, so partial outputs are never lost or applied twice. An
instance switch first awaits every move away from it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dora_megatron.controller.loop import (CheckpointSaved, ControllerLoop, EngineReply, EventQueue, InstanceFailed,
                                           InstanceJoined, InstanceStats, MigrationDone, MigrationFailed, Replayed,
                                           Resume, Start, Stop, SwitchDone, Tick, TrainerDone)
from dora_megatron.controller.records import (Engine, GroupRecord, LoadReports, RuntimeOptions, SampleRecord,
                                              StepLog, Trainer)
from dora_megatron.data.codec import CharCodec, TextCodec
from dora_megatron.data.tasks import PromptSource
from dora_megatron.orchestrator import (Dispatch, Interrupt, Migrate, Orchestrator, ReleaseBatch, Submit,
                                        SwitchVersion, perform)
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.observability.rollout_dump import RolloutDumper
from dora_megatron.observability.summary import RunTotals
from dora_megatron.workflow.runner import WorkflowFailed
from dora_megatron.controller.siblings import finished_sources, push_source, running_targets
from dora_megatron.rollout.speculation import speculation_summary

log = logging.getLogger(__name__)

#: refusals in a row of requests routed for an instance's own version (no switch under way) after
#: which the instance is failed as out of step with the controller (:meth:`Runtime._out_of_step`)
OUT_OF_STEP_REFUSALS = 3


#: back-off between tries of a call that failed for want of a local resource (seconds, doubling)
LOCAL_RETRY_S = (0.05, 1.0)


def _is_local(err: BaseException) -> bool:
    """A shortage of the controller's own process (no descriptor, no buffer, no pooled connection
    in time: :func:`~dora_megatron.comm.limits.local_resource_error`): never an instance's fault."""
    from dora_megatron.comm.limits import local_resource_error

    return local_resource_error(err)


def _is_comm_error(err: BaseException) -> bool:
    """Errors that mean "this engine cannot be reached or refused to work": the instance is failed."""
    from dora_megatron.comm.engine_client import EngineError, ExtensionUnsupported

    if isinstance(err, (EngineError, ExtensionUnsupported, OSError, asyncio.TimeoutError, ConnectionError)):
        return True
    return type(err).__module__.split(".")[0] == "aiohttp"


async def abort_until_returned(engine: Engine, sample_id: str, prev: asyncio.Task | None) -> None:
    """Abort ``sample_id`` until its in-flight ``/generate`` (``prev``) has returned.

    WHY repeat: an abort's answer proves nothing. SGLang answers 200 with an empty body whether or
    not anything matched, and drops the abort of a rid its tokenizer has not seen yet
    (tokenizer_manager.py ``abort_request``), which is the case while the ``/generate`` is still on
    its way; the embedded engine answers 404 then. Only the return of the generate says the abort
    took effect (or the request finished first). The wait between tries doubles from 20 ms to 1 s,
    so a long generation is not flooded with aborts."""
    await _abort_once(engine, sample_id)
    delay = 0.02
    while prev is not None and not prev.done():
        done, _ = await asyncio.wait([prev], timeout=delay)
        if done:
            break
        await _abort_once(engine, sample_id)
        delay = min(1.0, delay * 2)


async def _abort_once(engine: Engine, sample_id: str) -> None:
    """One abort; one that could not be sent for a local shortage (:func:`_is_local`) is simply
    tried again by the caller's next round (the instance is not at fault)."""
    try:
        await engine.abort(sample_id)
    except Exception as err:  # noqa: BLE001
        if not _is_local(err):
            raise
        log.debug("abort of %s not sent (local shortage): %s", sample_id, err)


def _clear_stale_checkpoint(path: Path) -> None:
    """Remove an old checkpoint directory about to be rewritten: the completion marker first, so a
    crash part-way leaves an incomplete (ignored) directory, never a mix of two lineages."""
    import shutil

    (path / "controller.json").unlink(missing_ok=True)
    log.info("replacing the stale checkpoint %s", path)
    shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class _Batch:
    """What the trainer was handed for one step, kept for its step log."""

    wait_s: float
    rewards: list
    lengths: list
    staleness: list
    tokens: int
    group_ids: tuple
    versions: tuple


class Runtime:
    """Runs ``options.steps`` training steps; returns the run summary (DESIGN section 11).

    The executor of :class:`~dora_megatron.controller.loop.ControllerLoop`: it implements
    :class:`~dora_megatron.orchestrator.ActionHandler` (one method per action, each starting
    asyncio tasks) and the per-event bookkeeping the loop asks of it."""

    def __init__(self, orch: Orchestrator, engines: dict[str, Engine], trainer: Trainer, source: PromptSource,
                 reward_fn: Callable[[str, str], float], options: RuntimeOptions, *, timeline=None,
                 on_step: Callable[[StepLog, "Runtime"], None] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None, first_prompt: int = 0,
                 codec: TextCodec | None = None, journal=None, metrics: MetricsRecorder | None = None,
                 load_reports: LoadReports | None = None, rollout_dump: RolloutDumper | None = None) -> None:
        """``load_reports``: pushed load reports of the engines it covers, taken once per stats
        sweep instead of polling them (e.g. :class:`~dora_megatron.rollout.sharded.ClientPool`).
        ``rollout_dump``: writes some of each step's samples as the trainer is handed them
        (``observability.dump_rollouts``)."""
        self.rollout_dump = rollout_dump
        #: the eval set's rounds (:class:`~dora_megatron.controller.evaluation.Evaluator`, ``data.eval_path``)
        self.evaluator = None
        #: ``rollout.workflow`` (:class:`~dora_megatron.workflow.runner.WorkflowRunner`); None: one
        #: ``/generate`` per submission (the default single turn)
        self.workflow = None
        self.orch = orch
        self.load_reports = load_reports
        self.engines = engines
        self.trainer = trainer
        self.source = source
        self.reward_fn = reward_fn
        self.opt = options
        self.timeline = timeline
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint  # at each checkpoint's cut (the launcher's snapshot retention)
        self.next_prompt = first_prompt
        self.codec: TextCodec = codec or CharCodec()
        self.journal = journal  # :class:`~dora_megatron.controller.journal.Journal` or None
        #: every metric of the run (summary.json, steps.jsonl, TensorBoard) comes from these events
        self.metrics = metrics or MetricsRecorder(slots_per_instance=options.slots_per_instance,
                                                  rebalancer=orch.policy.rebalance)
        self._from_journal: dict[str, Any] = {}  # sample id -> JournaledSample, restorable on resume
        self.samples_from_journal = 0
        self.samples_finished = 0  # engine answers that completed a sample (records of consumed groups are gone)
        #: execution data (token ids, logprobs, tasks) of the outstanding groups only: a group's
        #: records go once the trainer was handed it (the orchestrator owns which groups exist and
        #: are consumed, consumed.jsonl records them), so memory is O(outstanding work)
        self.samples: dict[str, SampleRecord] = {}
        self.groups: dict[str, GroupRecord] = {}
        #: the step logs of this process only (the run's are steps.jsonl's rows; a checkpoint keeps
        #: their count, not them, so its size does not grow with the step count)
        self.steps: list[StepLog] = []
        self.steps_done = 0  # steps of the run so far, resumed ones included
        self.failed_ever: set[str] = set()  # every instance that failed at least once (rejoined ones too)
        self.rejoins = 0  # failed instances that came back (``add_instance`` of a failed name)
        self.samples_after_rejoin = 0  # samples finished on an instance after it rejoined
        self._rejoined: set[str] = set()
        #: engine processes restarted by a supervising launcher (None: no supervisor, e.g. SLURM)
        self.engine_restarts: int | None = None
        #: set by a supervisor that restarts failed instances: losing all of them is not fatal then
        #: (the supervisor ends the run when no restart is left)
        self.instances_may_return = False
        #: instances not ready when the job started (name -> why): out of the pool until they join
        self.absent_at_start: dict[str, str] = {}
        self._late_starters: set[str] = set()  # of those, the ones that never failed (only slow to load)
        self.migrated_bytes = 0
        self.migrations_done = 0
        self.migrations_fallback = 0
        self.checksum_mismatches = 0
        #: instances whose weights check cannot run (no ``/weights_checker``, no checksum action):
        #: the check is off for them, after one warning each; only a checksum that differs fails one
        self.checksum_off: set[str] = set()
        #: instances whose answers carry no routed_experts although asked for (same rule)
        self.routed_experts_off: set[str] = set()
        self.spec_stats: dict[str, dict[str, Any]] = {}  # each embedded instance's latest speculation counters
        self.weight_sync_timeouts = 0
        #: calls that failed for a shortage of the controller's own process (EMFILE, ENOBUFS, a
        #: full pool): retried or re-queued, never counted against the instance
        self.local_resource_errors = 0
        #: this process's back-pressure count (calls that waited for a pooled connection), set by
        #: the launcher that sized the pools (:class:`~dora_megatron.comm.limits.ConnectionWaits`)
        self.connection_waits = None
        self.expected_checksums: dict[int, str] = {}
        #: version -> SGLang's own checksum of it (``/weights_checker``), as the first instance that
        #: loaded it reported: SGLang's checksum is comparable between instances only
        self.instance_checksums: dict[int, str] = {}
        # instance -> what a switch of it waits for: migrations into it (until they end), migrations
        # out of it (until the source let the request go) and interrupts
        self._moves_at: dict[str, set[asyncio.Future]] = {}
        self._switching: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self.events = EventQueue()  # read by the ControllerLoop of :meth:`run`
        self._t0 = 0.0
        self._trainer_idle_since = 0.0
        self._version_of: dict[str, int] = {iid: 0 for iid in engines}
        self._wall_offset = 0.0
        self._resumed = False
        self._pending_step_finished: int | None = None
        self._pushes: list[SwitchVersion] = []  # collected by switch_version within one execute
        self._trainer_manifest: dict[str, dict] = {}  # checksums of the trainer part of the checkpoint being written
        self._state_writer: Iterator[None] | None = None  # the controller.json writer still running (state_file)
        self.version_refusals = 0
        self._refusal_streak: dict[str, int] = {}  # instance -> refusals in a row of its own version
        #: a stop asked from outside (the launcher's first SIGINT/SIGTERM/SIGUSR1): its reason, and the
        #: version of the checkpoint written for it (None: none yet, or the step was abandoned)
        self.stop_reason: str | None = None
        self.stop_checkpoint: int | None = None
        self._stop_at_boundary = False
        self.latest_version = 0  # newest weights the trainer holds (pushed by `distributed`)
        self.pushed_bytes = 0

    # ------------------------------------------------------------------ helpers
    def is_failed(self, instance: str) -> bool:
        """Whether ``instance`` is failed (one the orchestrator does not know is): the orchestrator's
        view (it owns run state), not a copy. O(1): what a launcher's poller asks per instance."""
        return not self.orch.is_alive(instance)

    def all_failed(self) -> bool:
        """Whether the pool has instances and none is alive. O(1) while the orchestrator counts none
        alive, else it stops at the first alive instance: pollers ask it every poll, at 4,096 instances."""
        if not self.engines:
            return False
        return self.orch.alive_count() == 0 or not any(self.orch.is_alive(iid) for iid in self.engines)

    @property
    def failed(self) -> set[str]:
        """The pool's failed instances, O(pool): for tests, which compare the whole set; pollers ask
        :meth:`is_failed` / :meth:`all_failed` instead."""
        return {iid for iid in self.engines if self.is_failed(iid)}

    def now(self) -> float:
        return time.monotonic() - self._t0 + self._wall_offset

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._guard(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - any failure stops the run with its cause
            log.exception("runtime task failed")
            self.stop(err)

    def execute(self, actions: list) -> None:
        """Carry out one orchestrator answer (called by the loop only). Switches to the weights the
        trainer still holds (``distributed`` transport) are collected over the whole list and done
        with one broadcast."""
        self._pushes: list[SwitchVersion] = []
        perform(self, actions)
        pushes, self._pushes = self._pushes, []
        if pushes:
            prevs = {a.instance: self._switching.get(a.instance) for a in pushes}
            task = self._spawn(self._push_switch(pushes, prevs), f"push-v{pushes[0].version}")
            for a in pushes:
                self._switching[a.instance] = task

    # ------------------------------------------------------------------ ActionHandler
    def submit(self, a: Submit) -> None:
        self._chain(a.sample_id, self._submit(a), f"submit-{a.sample_id}")

    def migrate(self, a: Migrate) -> None:
        # A switch of the source waits only until the source has let the request go (exported, or
        # aborted with its partial output back), not for the move's task: that task lasts until
        # the request *finishes* at the destination (the import answers with the final response).
        # Waiting for it kept a freed instance idle through the whole tail of the requests moved
        # off it, which is the wait DORA's partition exists to remove. A switch of the destination
        # waits for the whole move.
        released = asyncio.get_running_loop().create_future()
        task = self._concurrent(a.sample_id, lambda prev: self._migrate(a, prev, released), f"migrate-{a.sample_id}")
        task.add_done_callback(lambda t: released.done() or released.set_result(None))
        self._track_move(a.src, released)
        self._track_move(a.dst, task)

    def _track_move(self, instance: str, fut: asyncio.Future) -> None:
        self._moves_at.setdefault(instance, set()).add(fut)
        fut.add_done_callback(lambda f: self._moves_at.get(instance, set()).discard(f))

    def interrupt(self, a: Interrupt) -> None:
        task = self._concurrent(a.sample_id, lambda prev: self._interrupt(a, prev), f"interrupt-{a.sample_id}")
        self._track_move(a.instance, task)

    def switch_version(self, a: SwitchVersion) -> None:
        if self.opt.weight_transport == "distributed" and a.version == self.latest_version and a.version > 0:
            self._pushes.append(a)  # the trainer still holds these weights: broadcast them once (execute)
            return
        prev = self._switching.get(a.instance)  # loads on one instance run in order
        self._switching[a.instance] = self._spawn(self._switch(a, prev, self.engines[a.instance]),
                                                  f"switch-{a.instance}")

    def _chain(self, sample_id: str, coro, name: str) -> asyncio.Task:
        """Run ``coro`` after the sample's previous operation finished (per-sample ordering)."""
        rec = self.samples[sample_id]
        prev = rec.task

        async def run():
            if prev is not None and not prev.done():
                await asyncio.wait([prev])
            await coro

        rec.task = self._spawn(run(), name)
        return rec.task

    def _concurrent(self, sample_id: str, make_coro, name: str) -> asyncio.Task:
        """Run an operation that acts on the sample's in-flight request (it does not wait for it);
        later operations on the sample wait for both."""
        rec = self.samples[sample_id]
        prev = rec.task
        task = self._spawn(make_coro(prev), name)

        async def both():
            await asyncio.wait([t for t in (prev, task) if t is not None])

        rec.task = self._spawn(both(), f"{name}-join")
        return task

    def dispatch(self, a: Dispatch) -> None:
        prompt = self.source.get(self.next_prompt)
        self.next_prompt += 1
        prompt_ids = self.codec.encode_prompt(prompt)
        self.groups[a.group_id] = GroupRecord(a.group_id, a.version, prompt, tuple(a.sample_ids), self.now())
        for i, sid in enumerate(a.sample_ids):
            self.samples[sid] = SampleRecord(sid, a.group_id, i, a.version, list(prompt_ids))
        if self.journal is not None:
            self.journal.dispatch(a.group_id, a.version, prompt.index, list(a.sample_ids))
        if self._from_journal:
            self._restore_from_journal(a.group_id)

    def prompt_tokens(self, group_id: str) -> int:
        """Loop: the prompt length of a dispatched group (the orchestrator's re-prefill accounting)."""
        return len(self.samples[self.groups[group_id].sample_ids[0]].prompt_ids)

    # ------------------------------------------------------------------ journal (resume)
    def load_journal(self, samples: dict[str, Any]) -> None:
        """After :meth:`load_state_dict`: finished samples the journal recorded after the checkpoint
        (:func:`~dora_megatron.controller.journal.read_journal`). Those of restored groups are filled
        in now, those of groups dispatched again later when they are (same id, version, prompt)."""
        self._from_journal = dict(samples)
        for gid in list(self.groups):
            self._restore_from_journal(gid)

    def _restore_from_journal(self, group_id: str) -> None:
        if self.workflow is not None:  # the journal keeps no loss mask: a workflow's samples run again
            return
        group = self.groups[group_id]
        for sid in group.sample_ids:
            j = self._from_journal.pop(sid, None)
            rec = self.samples[sid]
            if (j is None or rec.finished or j.group_id != group_id or j.version != group.version
                    or j.prompt_index != group.prompt.index or rec.version != j.version):
                continue
            rec.output_ids, rec.logprobs = list(j.output_ids), list(j.logprobs)
            rec.reward, rec.versions = j.reward, {j.version}
            rec.routed_experts, rec.finish_reason = j.routed_experts, j.finish_reason
            rec.finished = rec.replay_pending = True

    def replayed(self, sample_id: str) -> int | None:
        """Loop (:class:`Replayed`): the orchestrator asked to run a sample the journal restored: it
        is finished already. Returns its length, None when it was reported before."""
        rec = self.samples[sample_id]
        if not rec.replay_pending:
            return None
        rec.replay_pending = False
        self.samples_from_journal += 1
        if self.journal is not None:  # still finished after this lineage's checkpoint
            js = self._journaled(rec)
            self.journal.sample(js, sorted(rec.versions), replayed=True)
            self.journal.replayed(js)
        return len(rec.output_ids)

    def _journaled(self, rec: SampleRecord):
        """``rec`` as the journal records it (:class:`~dora_megatron.controller.journal.JournaledSample`)."""
        from dora_megatron.controller.journal import JournaledSample

        return JournaledSample(rec.sample_id, rec.group_id, rec.version, self.groups[rec.group_id].prompt.index,
                               tuple(rec.output_ids), tuple(rec.logprobs), float(rec.reward), rec.routed_experts,
                               rec.finish_reason)

    def _local_shortage(self, what: str, err: BaseException) -> None:
        """Count a call that failed for the controller's own shortage; the first and every 1,000th are logged."""
        self.local_resource_errors += 1
        if self.local_resource_errors == 1 or self.local_resource_errors % 1000 == 0:
            log.warning("%s: a local resource shortage of the controller, not the instance's fault (retried; "
                        "%d so far, counted as local_resource_errors): %s", what, self.local_resource_errors, err)

    def _sampling(self, rec: SampleRecord) -> dict[str, Any]:
        seed = zlib.crc32(f"{self.opt.seed}/{rec.sample_id}/{rec.submissions}".encode()) & 0x7FFFFFFF
        return {
            "max_new_tokens": max(1, self.opt.max_new_tokens - len(rec.output_ids)),
            "temperature": self.opt.temperature, "top_p": self.opt.top_p, "top_k": self.opt.top_k,
            "stop_token_ids": list(dict.fromkeys([*self.codec.eos_ids, *self.opt.stop_token_ids])),
            "sampling_seed": seed,
        }

    async def _submit(self, a: Submit) -> None:
        from dora_megatron.comm.engine_client import VersionMismatch

        rec = self.samples.get(a.sample_id)
        if rec is None:  # an earlier operation finished it and its group was consumed meanwhile
            return
        if rec.finished:
            if rec.replay_pending:
                await self.events.report(Replayed(a.sample_id))
            return
        rec.submissions += 1
        if self.workflow is not None:  # a workflow's trajectory runs whole again: nothing of an earlier version is kept
            rec.versions.clear()
        rec.versions.add(a.version)
        rec.version = a.version
        engine = self.engines[a.instance]
        rec.gen_task, rec.gen_instance = asyncio.current_task(), a.instance
        delay, deadline = LOCAL_RETRY_S[0], time.monotonic() + self.opt.request_timeout_s
        while True:
            start = self.now()
            try:
                resp = await self._generate(engine, rec, a)
                break
            except VersionMismatch as err:
                # the engine's C1 guard refused it (it holds another version): nothing ran, re-queue it
                log.warning("C1 guard: %s refused %s for version %d: %s", a.instance, a.sample_id, a.version,
                            err.message)
                self.version_refusals += 1
                if self._out_of_step(a.instance, a.version):
                    await self.events.report(InstanceFailed(
                        a.instance, f"serves another weight version than the {a.version} it was switched to "
                        f"({OUT_OF_STEP_REFUSALS} requests in a row refused: {err.message})", engine))
                else:
                    await self.events.report(MigrationFailed(a.sample_id))
                return
            except WorkflowFailed as err:
                if err.final:
                    raise
                await self.events.report(MigrationFailed(a.sample_id))  # its environment crashed: run it again
                return
            except Exception as err:  # noqa: BLE001
                if _is_local(err):
                    # the controller's own shortage (no descriptor, no pooled connection): the instance
                    # is not at fault; the same call is tried again after a back-off
                    self._local_shortage(f"generate of {a.sample_id} on {a.instance}", err)
                    if not self.is_current(a.instance, engine):
                        return  # failed or replaced meanwhile: its requests are re-queued already
                    if time.monotonic() + delay > deadline:  # short for a whole request timeout: run it later
                        await self.events.report(MigrationFailed(a.sample_id))
                        return
                    await asyncio.sleep(delay)
                    delay = min(LOCAL_RETRY_S[1], delay * 2)
                    continue
                if not _is_comm_error(err):
                    raise
                await self.events.report(InstanceFailed(a.instance, f"generate failed: {err}", engine))
                return
        self._refusal_streak.pop(a.instance, None)
        await self.events.report(EngineReply(a.sample_id, a.instance, resp, start, self.now()))

    async def _generate(self, engine: Engine, rec: SampleRecord, a: Submit):
        """One submission's answer: the engine's, or with ``rollout.workflow`` the whole trajectory
        its workflow generated on this instance with this version (every turn pinned to it)."""
        if self.workflow is None:
            return await engine.generate(rec.prompt_ids + rec.output_ids, self._sampling(rec), rid=a.sample_id,
                                         return_logprob=True, version=a.version,
                                         **({"routed_experts": True} if self.opt.routed_experts else {}),
                                         **({"draft_sources": finished_sources(rec, self._siblings(rec))}
                                            if self.opt.draft_siblings else {}))
        return await self.workflow.run(engine, self.groups[rec.group_id].prompt, rec.prompt_ids,
                                       sample_id=a.sample_id, version=a.version, sampling=self._sampling(rec),
                                       routed_experts=self.opt.routed_experts)

    def _siblings(self, rec: SampleRecord) -> list[SampleRecord | None]:
        return [self.samples.get(s) for s in self.groups[rec.group_id].sample_ids]

    def _out_of_step(self, instance: str, version: int) -> bool:
        """Whether ``instance`` has now refused :data:`OUT_OF_STEP_REFUSALS` requests in a row routed
        for the version the controller last switched it to, with no switch of it under way. A refusal
        racing a switch is normal; refusals of the instance's own version are not: it serves other
        weights than the controller believes (started on another checkpoint, a reload that did not
        take), and re-queueing its samples onto it would go on for ever. Failing it hands it to the
        supervisor's restart, which loads the version the controller expects."""
        switch = self._switching.get(instance)
        if self._version_of.get(instance) != version or (switch is not None and not switch.done()):
            self._refusal_streak.pop(instance, None)
            return False
        self._refusal_streak[instance] = self._refusal_streak.get(instance, 0) + 1
        return self._refusal_streak[instance] >= OUT_OF_STEP_REFUSALS

    def absorb(self, ev: EngineReply) -> int | None:
        """Loop (:class:`EngineReply`): apply an engine response. Finished: the sample's length (the
        orchestrator hears of it); aborted: the partial output is kept, None. A late answer about a
        sample whose group was consumed meanwhile (the source's reply to a KV export) is dropped."""
        rec, resp, instance, start, end = self.samples.get(ev.sample_id), ev.resp, ev.instance, ev.start, ev.end
        self.metrics.request_held_slot(start, end)
        if rec is None:
            return None
        if getattr(resp, "migrated", False):
            return None  # the import on the destination delivers this sample
        if self.timeline is not None:
            self.timeline.span(instance, rec.sample_id, start, end, version=rec.version, kind="request")
        rec.output_ids.extend(resp.output_ids)
        rec.logprobs.extend(resp.output_token_logprobs or [0.0] * len(resp.output_ids))
        # an answer that crossed a weight update (SGLang's meta_info.weight_versions) produced its
        # tokens under several versions; each is recorded, not just the routed one
        rec.versions.update(int(v) for v in getattr(resp, "versions_used", ()) if str(v).lstrip("-").isdigit())
        reason = (resp.finish_reason or {}).get("type")
        if reason == "abort":
            return None  # interrupted (partial mode) or failed over: a later Submit(resume) continues it
        if self.opt.routed_experts:  # covers prompt + every output token (the last submission's input is all of it)
            rec.routed_experts = (resp.raw.get("meta_info") or {}).get("routed_experts")
            if rec.routed_experts is None and instance not in self.routed_experts_off:
                # an optional probe that cannot run there (SGLang without --enable-return-routed-experts
                # answers without them): the instance is not failed for it, one warning, counted
                self.routed_experts_off.add(instance)
                log.warning("%s answers without routed_experts (launched without "
                            "--enable-return-routed-experts?); its samples carry none (counted as "
                            "routed_experts_unavailable)", instance)
        rec.finished = True
        rec.finish_reason = reason
        if self.opt.draft_siblings:
            targets = running_targets(rec, self._siblings(rec))
            self._spawn(push_source(self.engines, targets, rec.prompt_ids + rec.output_ids), f"drafts-{rec.sample_id}")
        self.samples_finished += 1
        if instance in self._rejoined:
            self.samples_after_rejoin += 1
        group = self.groups[rec.group_id]
        if getattr(resp, "loss_mask", None) is not None:  # a workflow's trajectory (rollout.workflow)
            rec.prompt_ids, rec.loss_mask = list(resp.prompt_ids), list(resp.loss_mask)
        if getattr(resp, "reward", None) is not None:
            rec.reward = float(resp.reward)
        else:  # the reward sees the model's tokens only, not the tools' results
            model = rec.output_ids if rec.loss_mask is None else [t for t, m in zip(rec.output_ids, rec.loss_mask) if m]
            rec.reward = float(self.reward_fn(self.codec.decode(model), group.prompt.answer))
        if self.journal is not None:
            self.journal.sample(self._journaled(rec), sorted(rec.versions))
        return len(rec.output_ids)

    def sample_versions(self, sample_id: str) -> set[int]:
        """Loop: every version the sample was submitted on or an engine said produced its tokens;
        the orchestrator counts a sample of more than one as a C1 violation (the one C1 count)."""
        return self.samples[sample_id].versions

    async def _migrate(self, a: Migrate, prev: asyncio.Task | None, released: asyncio.Future) -> None:
        """Move one request from ``a.src`` to ``a.dst``; ``released`` is set once the source no
        longer holds it (a switch of the source may then go ahead)."""
        from dora_megatron.comm.engine_client import EngineError

        rec = self.samples.get(a.sample_id)
        if rec is None or rec.finished:  # finished (its group maybe consumed) before this move ran
            return
        src, dst = self.engines[a.src], self.engines[a.dst]
        start = self.now()
        blob = None
        try:
            # a workflow's trajectory moves between turns only: abort + resubmit runs it again on dst
            use_kv = (self.workflow is None and self.opt.migration == "kv" and await src.supports("export_request")
                      and await dst.supports("import_request"))
            if use_kv:
                for _ in range(50):  # the generate may not have reached the engine yet
                    try:
                        blob = await src.export_request(a.sample_id)
                        break
                    except EngineError as err:
                        if err.status != 404:
                            raise
                        if rec.finished:
                            return
                        await asyncio.sleep(0.02)
        except Exception as err:  # noqa: BLE001 - the source is unreachable: re-run the sample elsewhere
            if _is_local(err):  # the controller's shortage: move it the other way (abort + resubmit)
                self._local_shortage(f"export of {a.sample_id} from {a.src}", err)
                blob = None
            elif not _is_comm_error(err):
                raise
            else:
                await self.events.report(InstanceFailed(a.src, f"export failed: {err}", src))
                await self.events.report(MigrationFailed(a.sample_id))
                return
        if blob is not None:
            released.set_result(None)  # the export removed it from the source
            self.migrated_bytes += len(blob)
            self.migrations_done += 1
            if self.timeline is not None:
                self.timeline.span(a.dst, f"migrate-in {a.sample_id}", start, self.now(), version=a.version, kind="migration")
            try:
                resp = await dst.import_request(blob)
            except Exception as err:  # noqa: BLE001 - the destination failed: its requests are re-queued
                if _is_local(err):  # the controller's shortage: the sample runs again from what it holds
                    self._local_shortage(f"import of {a.sample_id} into {a.dst}", err)
                    await self.events.report(MigrationFailed(a.sample_id))
                    return
                if not _is_comm_error(err):
                    raise
                await self.events.report(InstanceFailed(a.dst, f"import failed: {err}", dst))
                return
            await self.events.report(EngineReply(a.sample_id, a.dst, resp, start, self.now()))
            return
        # Fallback (SGLang): abort at src, resubmit prompt + partial output at dst (re-prefill).
        try:
            await abort_until_returned(src, a.sample_id, prev)
        except Exception as err:  # noqa: BLE001
            if not _is_comm_error(err):
                raise
            await self.events.report(InstanceFailed(a.src, f"abort failed: {err}", src))
            await self.events.report(MigrationFailed(a.sample_id))
            return
        if prev is not None and not prev.done():
            await asyncio.wait([prev])  # the aborted generate's partial output is applied (absorb)
        released.set_result(None)  # aborted at the source, its partial output applied
        if rec.finished:
            return  # it finished before the abort reached it: nothing to move
        self.migrations_fallback += 1
        reprefill = len(rec.prompt_ids) + len(rec.output_ids)
        await self.events.report(MigrationDone(a.sample_id, reprefill))
        await self._submit(Submit(a.sample_id, a.dst, a.version, resume=True))

    async def _interrupt(self, a: Interrupt, prev: asyncio.Task | None) -> None:
        """Abort the request and wait until its partial output is back (before the instance switches)."""
        await abort_until_returned(self.engines[a.instance], a.sample_id, prev)
        if prev is not None and not prev.done():
            await asyncio.wait([prev])

    async def _switch(self, a: SwitchVersion, prev: asyncio.Task | None = None, engine: Engine | None = None,
                      *, resume: bool = False) -> None:
        """``engine``: the instance's client when the switch was ordered (a switch ordered before the
        instance was restarted does not touch its new process). ``resume``: the load follows a
        failed push, which may have left the instance paused; a disk update does not clear
        SGLang's pause (every later ``/generate`` would wait), so generation is continued after it."""
        if prev is not None and not prev.done():
            await asyncio.wait([prev])
        moves = [t for t in self._moves_at.get(a.instance, ()) if not t.done()]
        if moves:
            await asyncio.wait(moves)
        if self.evaluator is not None:  # a load waits for running requests: the eval's go elsewhere
            await self.evaluator.vacate([a.instance])
        try:
            if self._superseded(a.instance):
                return
            engine = engine if engine is not None else self.engines[a.instance]
            if self.is_failed(a.instance) or self.engines.get(a.instance) is not engine:
                return  # failed (or replaced) while this switch waited: the orchestrator no longer expects it
            await self._switch_now(a, engine, resume)
        finally:
            if self.evaluator is not None:
                self.evaluator.reopen(a.instance)

    async def _switch_now(self, a: SwitchVersion, engine: Engine, resume: bool) -> None:
        start = self.now()
        self.metrics.weight_sync_started(a.instance, start, rebalance=a.rebalance)
        try:
            got = await asyncio.wait_for(self._load_weights_retrying(engine, a, resume=resume),
                                         timeout=self.opt.weight_sync_timeout_s)
        except asyncio.TimeoutError:
            self.weight_sync_timeouts += 1
            await self.events.report(InstanceFailed(
                a.instance, f"switch to v{a.version} did not finish within {self.opt.weight_sync_timeout_s:g} s "
                            "(controller.weight_sync_timeout_s)", engine))
            return
        except Exception as err:  # noqa: BLE001 - an instance that cannot load weights is failed
            await self.events.report(InstanceFailed(a.instance, f"switch to v{a.version} failed: {err}", engine))
            return
        finally:
            self.metrics.weight_sync_finished(a.instance, self.now())
        if got is not None:
            self.checksum_mismatches += 1
            await self.events.report(InstanceFailed(a.instance, got, engine))
            return
        await self.events.report(SwitchDone(a.instance, a.version, engine, start, self.now()))

    def switch_landed(self, ev: SwitchDone, origin: asyncio.Task | None) -> bool:
        """Loop (:class:`SwitchDone`): whether the orchestrator is to hear of it. Not when the
        instance failed or was replaced (restarted: its own switch follows) or was re-targeted
        while loading (``origin``, the task that loaded, is no longer its newest switch order:
        that order reports, after loading again)."""
        if self.is_failed(ev.instance) or self.engines.get(ev.instance) is not ev.engine:
            return False
        if self.timeline is not None:  # the time was spent loading, whether or not this order still stands
            self.timeline.span(ev.instance, f"{ev.how} v{ev.version}", ev.start, ev.end, version=ev.version,
                               kind="weight_sync")
        latest = self._switching.get(ev.instance)
        if origin is not None and latest is not None and latest is not origin:
            return False
        self._version_of[ev.instance] = ev.version
        if self.timeline is not None:
            self.timeline.set_version(ev.instance, ev.version, ev.end)
        return True

    def _superseded(self, instance: str) -> bool:
        """True when a newer switch of ``instance`` was ordered after the one running in this task.

        The orchestrator may re-target an instance before its switch ran (v2, then v0, then v2 again);
        only the newest order is carried out. Otherwise the first v2 load would report
        ``on_switch_done(v2)``, the orchestrator would route v2 requests to the instance, and the
        queued v0 load would then replace its weights under those requests."""
        latest = self._switching.get(instance)
        return latest is not None and latest is not asyncio.current_task()

    async def _load_weights_retrying(self, engine: Engine, a: SwitchVersion, *, resume: bool) -> str | None:
        """:meth:`_load_weights`, tried again after a back-off while it fails for a local shortage
        of the controller (bounded by the caller's ``weight_sync_timeout_s``): a load is idempotent."""
        delay = LOCAL_RETRY_S[0]
        while True:
            try:
                return await self._load_weights(engine, a.version, resume=resume, instance=a.instance)
            except Exception as err:  # noqa: BLE001
                if not _is_local(err):
                    raise
                self._local_shortage(f"switch of {a.instance} to v{a.version}", err)
                await asyncio.sleep(delay)
                delay = min(LOCAL_RETRY_S[1], delay * 2)

    async def _load_weights(self, engine: Engine, version: int, *, resume: bool = False,
                            instance: str = "") -> str | None:
        """Load snapshot ``version``; returns why the loaded weights are wrong (checksum), or None."""
        await engine.update_weights_from_disk(self.opt.snapshot_dir(version), weight_version=version)
        if resume and hasattr(engine, "continue_generation"):
            await engine.continue_generation()
        return await self._verify_weights(engine, version, instance)

    async def _verify_weights(self, engine: Engine, version: int, instance: str = "") -> str | None:
        """``controller.verify_checksums`` after every load, whatever moved the weights: the
        embedded engine's checksum equals the trainer's export checksum of ``version``; SGLang's
        own (``/weights_checker``) is compared with the one the first instance on ``version``
        reported. Returns the mismatch, or None.

        A check that cannot run on ``instance`` (:class:`ProbeUnavailable`: 404, 405, 501, an
        unsupported-action reply) says nothing about its weights: it is switched off for that
        instance with one warning (``checksum_unavailable`` in the summary), never a failure."""
        from dora_megatron.comm.engine_client import ProbeUnavailable

        key = instance or getattr(engine, "base_url", repr(engine))  # one key for the check and the switch
        if not self.opt.verify_checksums or key in self.checksum_off:
            return None
        try:
            return await self._compare_checksum(engine, version)
        except ProbeUnavailable as exc:
            if key not in self.checksum_off:
                self.checksum_off.add(key)
                log.warning("%s: the weights check cannot run there (%s); it is off for this instance "
                            "(counted as checksum_unavailable)", key, exc)
            return None

    async def _compare_checksum(self, engine: Engine, version: int) -> str | None:
        """The comparison itself (:meth:`_verify_weights`); raises :class:`ProbeUnavailable`."""
        if await engine.supports("weights_checksum"):
            if version not in self.expected_checksums:
                return None
            got = await engine.weights_checksum()
            want = self.expected_checksums[version]
            return None if got == want else (f"weights checksum mismatch for version {version}: engine {got[:16]}, "
                                             f"trainer {want[:16]}")
        instance_checksum = getattr(engine, "instance_checksum", None)
        got = await instance_checksum() if instance_checksum is not None else None
        if got is None:
            return None
        want = self.instance_checksums.setdefault(version, got)
        return None if got == want else (f"weights checksum mismatch for version {version}: /weights_checker "
                                         f"{got[:16]}, other instances on it {want[:16]}")

    def add_instance(self, name: str, engine: Engine) -> None:
        """Elastic pools: ``engine`` joins the running job as ``name`` (new, or a failed name coming
        back); the orchestrator switches it to the version it assigns, then routes work to it.
        Goes through the loop (:class:`InstanceJoined`), after any failure reported before it."""
        self.events.post(InstanceJoined(name, engine))

    def register(self, ev: InstanceJoined) -> bool:
        """Loop (:class:`InstanceJoined`): put the client in the pool; whether the orchestrator is to hear of it."""
        name = ev.instance
        if name in self.engines and not self.is_failed(name):
            log.warning("instance %s is already in the pool; ignoring its second join", name)
            return False
        self.engines[name] = ev.engine
        self._late_starters.discard(name)
        self.metrics.instance_joined(name, self.now())
        if name in self.failed_ever and self.is_failed(name):  # (a new name is unknown to the orchestrator too)
            self.rejoins += 1
            self._rejoined.add(name)
            log.info("instance %s rejoined the pool", name)
        else:
            log.info("instance %s joined the pool", name)
        return True

    def start_without(self, absent: dict[str, str], loading: set[str] = frozenset()) -> None:
        """Call before :meth:`run`: the run starts without ``absent`` (name -> why they are not ready;
        the launcher adds each once it serves, :meth:`add_instance`). ``loading``: those of them that
        did not fail, only were not ready yet (they are not counted as failed instances)."""
        self.absent_at_start = dict(absent)
        self._late_starters = set(loading) & set(absent)

    def is_current(self, instance: str, engine: Engine) -> bool:
        """Loop: ``engine`` is still ``instance``'s client and the instance has not failed."""
        return not self.is_failed(instance) and self.engines.get(instance) is engine

    async def _push_switch(self, actions: list[SwitchVersion], prevs: dict[str, asyncio.Task | None]) -> None:
        """Switch several instances to the newest version with one trainer broadcast (W1 `distributed`).

        Falls back to the per-version snapshot (disk) for every instance if the broadcast fails."""
        waits = [t for t in prevs.values() if t is not None and not t.done()]
        waits += [t for a in actions for t in self._moves_at.get(a.instance, ()) if not t.done()]
        if waits:
            await asyncio.wait(waits)
        live = [a for a in actions if not self.is_failed(a.instance) and not self._superseded(a.instance)]
        if not live:
            return
        if self.evaluator is not None:  # a broadcast waits for running requests too
            await self.evaluator.vacate([a.instance for a in live])
        try:
            await self._push_now(live)
        finally:
            if self.evaluator is not None:
                for a in live:
                    self.evaluator.reopen(a.instance)

    async def _push_now(self, live: list[SwitchVersion]) -> None:
        start = self.now()
        broadcast = self.metrics.trainer_sync_started(start)
        for a in live:
            self.metrics.weight_sync_started(a.instance, start, rebalance=a.rebalance)
        try:
            urls = [getattr(self.engines[a.instance], "base_url") for a in live]
            result = await self.trainer.push_weights(urls, timeout_s=self.opt.weight_sync_timeout_s,
                                                     **self.opt.push.request(urls))
        except Exception as err:  # noqa: BLE001 - the snapshot path still works
            log.warning("weight broadcast of v%d failed (%s); loading the snapshot instead", live[0].version, err)
            result = None
        finally:
            self.metrics.trainer_sync_finished(broadcast, self.now())
            if self.timeline is not None:
                self.timeline.span("trainer", f"broadcast v{live[0].version}", start, self.now(), kind="broadcast")
        pushed = None if result is None else result.get("version")
        if pushed is not None and int(pushed) != live[0].version:
            # the trainer finished another step while this push waited: it sent newer weights than
            # the orchestrator assigned (C1) -- load the assigned version's snapshot instead
            log.info("the trainer sent v%s instead of v%d (it trained on meanwhile); loading the snapshot",
                     pushed, live[0].version)
            result = None
        if result is None:
            for a in live:
                self.metrics.weight_sync_finished(a.instance, self.now())  # each snapshot load times itself
                await self._switch(a, resume=True)
            return
        if result.get("checksum") and live[0].version not in self.expected_checksums:
            self.expected_checksums[live[0].version] = str(result["checksum"])
        end = self.now()
        for a in live:
            self.metrics.weight_sync_finished(a.instance, end)
        self.pushed_bytes += int(result.get("bytes", 0))
        engines = {a.instance: self.engines[a.instance] for a in live}
        checks = await asyncio.gather(*(self._verify_weights(engines[a.instance], a.version, a.instance)
                                        for a in live),
                                      return_exceptions=True)  # concurrently: a checksum can take seconds
        for a, wrong in zip(live, checks):
            engine = engines[a.instance]
            if isinstance(wrong, BaseException):
                if not _is_comm_error(wrong):
                    raise wrong
                await self.events.report(InstanceFailed(
                    a.instance, f"weights check after the push of v{a.version} failed: {wrong}", engine))
                continue
            if wrong is not None:
                self.checksum_mismatches += 1
                await self.events.report(InstanceFailed(a.instance, wrong, engine))
                continue
            await self.events.report(SwitchDone(a.instance, a.version, engine, start, end, how="push"))

    def report_failure(self, instance: str, why: str, engine: Engine | None = None) -> None:
        """For launchers (a supervisor saw the process exit, a node restarted it): ``instance``
        failed. Goes through the loop like every other event."""
        self.events.post(InstanceFailed(instance, why, engine))

    def mark_failed(self, ev: InstanceFailed, origin: asyncio.Task | None) -> bool:
        """Loop (:class:`InstanceFailed`): whether the orchestrator is to hear of it. ``ev.engine``:
        the client the failing call used; a failure seen through a client that has since been
        replaced (the instance was restarted and rejoined) is stale and ignored. The requests in
        flight there are cancelled (not the one that reported, ``origin``)."""
        instance, why = ev.instance, ev.why
        if self.is_failed(instance) or instance not in self.engines:
            return False
        if ev.engine is not None and self.engines.get(instance) is not ev.engine:
            log.info("ignoring a stale failure of %s (replaced since): %s", instance, why)
            return False
        log.warning("instance %s failed: %s", instance, why)
        self.metrics.instance_left(instance, self.now())
        if instance not in self._late_starters:
            self.failed_ever.add(instance)  # (the orchestrator hears of it next: it owns which instances are failed)
        for rec in self.samples.values():  # stop waiting on requests that lived there
            if rec.gen_instance == instance and rec.gen_task is not None and rec.gen_task is not origin \
                    and not rec.gen_task.done() and not rec.finished:
                rec.gen_task.cancel()
        if all(i == instance or self.is_failed(i) for i in self.engines) and not self.instances_may_return:
            self.stop(RuntimeError("every rollout instance failed"))
        return True

    def is_done(self) -> bool:
        """Whether the run was ended (:meth:`stop`): a supervisor stops acting on it then."""
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What ended the run, the first error given to :meth:`stop` (None: none so far)."""
        return self._error

    def stop(self, error: BaseException | None = None) -> None:
        """End the run (with ``error``, the first one wins): the loop stops after its current event."""
        if error is not None and self._error is None:
            self._error = error
        self._done.set()
        self.events.post(Stop())

    def release_batch(self, a: ReleaseBatch) -> None:
        """Hand the batch to the trainer: the groups are consumed now (exactly once), ``/train`` runs
        in a task that reports :class:`TrainerDone`."""
        start = self.now()
        wait = max(0.0, start - self._trainer_idle_since)
        samples, rewards, lengths, staleness, tokens = [], [], [], [], 0
        dumped: list[dict] = []  # what the rollout dump needs of each sample (not sent to the trainer)
        for gid, version in zip(a.group_ids, a.versions):
            group = self.groups.pop(gid, None)  # consumed now: its records go (the trainer gets their data)
            if group is None:  # the orchestrator never does this (it counts duplicated_groups)
                raise RuntimeError(f"group {gid} released twice (or never dispatched)")
            staleness.append(a.step - version)
            for sid in group.sample_ids:
                rec = self.samples.pop(sid)
                samples.append({
                    "prompt_ids": rec.prompt_ids, "response_ids": rec.output_ids, "rollout_logprobs": rec.logprobs,
                    "reward": rec.reward, "group_id": gid, "version": rec.version,
                    **({"routed_experts": rec.routed_experts} if rec.routed_experts is not None else {}),
                    **({"loss_mask": rec.loss_mask} if rec.loss_mask is not None else {}),
                })
                if self.rollout_dump is not None:
                    dumped.append({**samples[-1], "sample_id": sid, "finish_reason": rec.finish_reason})
                rewards.append(rec.reward)
                lengths.append(len(rec.output_ids))
                tokens += len(rec.prompt_ids) + len(rec.output_ids)
        if self.rollout_dump is not None:
            self.rollout_dump.dump(a.step, dumped)
        batch = _Batch(wait, rewards, lengths, staleness, tokens, tuple(a.group_ids), tuple(a.versions))
        self._spawn(self._train(a.step, samples, start, batch), f"train-{a.step}")

    async def _train(self, step: int, samples: list[dict], start: float, batch: _Batch) -> None:
        t_train = time.monotonic()
        result = await self.trainer.train(step, samples)
        train_s = time.monotonic() - t_train
        trained = self.now()
        # the trainer's own measures when it reports them: /train includes the snapshot export
        export_s = min(float(result.get("export_s") or 0.0), train_s)
        self.metrics.trainer_sync(trained - export_s, trained)
        train_s = float(result.get("train_s", train_s - export_s))
        await self.events.report(TrainerDone(step, result, start, train_s, batch))

    def record_step(self, ev: TrainerDone, live_versions: int) -> tuple[int, bool]:
        """Loop (:class:`TrainerDone`): log the step; returns the new weights' version and whether a
        checkpoint is due (then its trainer part is being written and :class:`CheckpointSaved` follows)."""
        result, b = ev.result, ev.batch
        new_version = int(result["version"])
        self.latest_version = new_version
        if result.get("checksum"):
            self.expected_checksums[new_version] = result["checksum"]
        end = self.now()
        metrics = dict(result.get("metrics", {}))
        if result.get("padding_fraction") is not None:  # a trainer that packs reports it beside its metrics
            metrics["padding_fraction"] = result["padding_fraction"]
        oc = self.orch.counters
        scalars = self.metrics.step_trained(
            ev.step, end_s=end, wait_s=b.wait_s, train_s=ev.train_s, tokens=b.tokens, staleness=b.staleness,
            rewards=b.rewards, response_lengths=b.lengths, live_versions=live_versions, metrics=metrics,
            migrations=oc.migrations, migrated_kv_bytes=self.migrated_bytes, reprefill_tokens=oc.reprefill_tokens)
        log_ = StepLog(ev.step, ev.start, end, b.wait_s, ev.train_s, scalars["perf/sync_time_s"], metrics, b.rewards,
                       b.lengths, b.staleness, b.tokens, live_versions, list(b.group_ids), list(b.versions))
        self.steps.append(log_)
        self.steps_done += 1
        if self.timeline is not None:
            self.timeline.span("trainer", f"step {ev.step}", ev.start, end, version=ev.step, kind="train",
                               produced=new_version)
        if self.on_step is not None:
            self.on_step(log_, self)
        self._trainer_idle_since = end
        finished = self.steps_done >= self.opt.steps
        last = finished or self.stop_reason is not None  # a stop ends the run here
        if self.evaluator is not None:  # a round of these weights, beside the rollout (or the final one)
            self.evaluator.after_step(self.steps_done, new_version, finished)
        due = self.opt.checkpoint_dir is not None and (
            last or bool(self.opt.checkpoint_interval and new_version % self.opt.checkpoint_interval == 0))
        if due and self.stop_reason is not None:
            self._stop_at_boundary = True  # the step ended in time: its checkpoint is not abandoned
        if due:
            # Trainer first, then the controller state, both at the same boundary: weights
            # ``new_version`` exist and the orchestrator has not yet reacted to them (resume
            # replays ``on_step_finished(new_version)``).
            self._spawn(self._checkpoint(new_version), f"checkpoint-v{new_version}")
        return new_version, due

    def step_boundary(self) -> bool:
        """Loop: after a step (and its checkpoint): True when it was the last one, or a stop was
        asked (the run ends; its checkpoint was written in this turn)."""
        if self.steps_done >= self.opt.steps or self.stop_reason is not None:
            self.stop()
            return True
        return False

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary with a checkpoint there (``reason``: e.g. ``SIGINT``),
        whatever ``checkpoint_interval`` says, so that ``--resume`` loses nothing.

        WHY at a boundary: a checkpoint is a cut where weights ``v`` exist and the orchestrator has
        not reacted to them; mid-step there is no such cut. Bounded: when no step ends within
        ``stop_checkpoint_timeout_s`` the step is abandoned (the run stops without a new
        checkpoint; the last complete one stays, ``--resume`` redoes what came after it). Only the
        first request counts (a second signal is the launcher's: it exits at once)."""
        if self.stop_reason is not None or self._done.is_set():
            return
        self.stop_reason = reason
        timeout = self.opt.stop_checkpoint_timeout_s
        log.warning("stop asked (%s): checkpoint at the end of the current step (at most %.0f s, "
                    "controller.stop_checkpoint_timeout_s), then exit", reason, timeout)
        self._spawn(self._abandon_after(timeout), "stop-timeout")

    async def _abandon_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if not self._stop_at_boundary and not self._done.is_set():
            log.warning("stop (%s): no step boundary within %.0f s (controller.stop_checkpoint_timeout_s): the "
                        "step is abandoned; the last complete checkpoint stays", self.stop_reason, timeout_s)
            self.stop()

    # ------------------------------------------------------------------ checkpoints
    async def _checkpoint(self, version: int) -> None:
        """Trainer part of checkpoint ``version`` (model + optimizer via dist_checkpointing)."""
        path = Path(self.opt.checkpoint_dir(version))
        if path.exists():  # left by a crashed lineage after the checkpoint this run resumed from
            await asyncio.to_thread(_clear_stale_checkpoint, path)
        path.mkdir(parents=True, exist_ok=True)
        start = self.now()
        await self.trainer.save_checkpoint(str(path / "trainer"))
        from dora_megatron.controller.checkpoint_manifest import describe_tree

        # checksums of what the trainer wrote (off the event loop: real checkpoints are large)
        self._trainer_manifest = await asyncio.to_thread(describe_tree, path, "trainer")
        if self.timeline is not None:
            self.timeline.span("trainer", f"checkpoint v{version}", start, self.now(), kind="checkpoint")
        await self.events.report(CheckpointSaved(version))

    def write_controller_state(self, version: int, orchestrator_snapshot: dict[str, Any]) -> None:
        """Loop (:class:`CheckpointSaved`): the controller part, taken before ``on_step_finished``
        so the orchestrator is at a step boundary.

        The state is cut in this loop turn (with the journal's marker, which splits exactly
        there); its encoding and files are written by a task a chunk per loop turn
        (:mod:`.state_file`: at thousands of instances one ``json.dumps`` of it held the loop for
        up to a second), chained after any earlier one. The run's last checkpoint is written at
        once (the run ends right after and stops its tasks), finishing an earlier one first.
        ``controller.json`` is written last and atomically: a checkpoint directory without it is
        incomplete and ignored by resume, which then falls back one checkpoint (the journal keeps
        the records since the one before, :mod:`.journal`). Just before it, ``manifest.json``
        (sizes and SHA-256 of the trainer's files and of ``controller.json``) lets resume detect a
        corrupt checkpoint."""
        from dora_megatron.controller.state_file import write_state

        path = Path(self.opt.checkpoint_dir(version))
        state = self.state_dict(version, orchestrator_snapshot)
        entries, self._trainer_manifest = self._trainer_manifest, {}

        def complete() -> None:
            log.info("checkpoint v%d written to %s", version, path)
            if self.journal is not None:
                self.journal.completed(version)

        writer = write_state(path, state, entries, complete)
        if self.journal is not None:
            self.journal.checkpoint(version)
        if self.on_checkpoint is not None:
            # in the turn of the cut too: the launcher's snapshot retention records the live
            # versions the checkpoint holds (later they have moved on, and a snapshot it needs
            # would be pruned); it keeps the previous checkpoint's as well, the fallback while
            # this one is being written
            self.on_checkpoint(version)
        if self.stop_reason is not None:
            self.stop_checkpoint = version  # written at once below: the run ends in this turn
        if self.steps_done >= self.opt.steps or self.stop_reason is not None:
            for pending in (self._state_writer, writer):
                for _ in pending or ():
                    pass
            self._state_writer = None
            return
        prev = self._state_writer
        self._state_writer = writer

        async def drive() -> None:
            for w in (prev, writer):
                for _ in w or ():
                    await asyncio.sleep(0)

        self._spawn(drive(), f"controller-state-v{version}")

    def state_dict(self, version: int, orchestrator_snapshot: dict[str, Any]) -> dict[str, Any]:
        """The controller part of a checkpoint, sized by outstanding work (DESIGN section 5.5): the
        outstanding groups' prompts, the finished samples' outputs, counters, the number of steps done.

        WHY nothing per step: the step logs and the metrics recorder's per-step rows are
        ``steps.jsonl``'s (:meth:`load_state_dict` takes them back from it), and the orchestrator
        snapshot already lists every outstanding group and sample with its version and ids; what is
        kept here is only what it does not hold (prompt and output tokens, rewards). Unfinished
        samples restart from their prompt on their own version (C1), so they need no entry."""
        groups = []
        samples = []
        for g in self.groups.values():  # consumed ones were forgotten at release
            # its prompt ids once per group (every sample of it has the same prompt)
            # (a finished workflow sample holds its workflow's own rendering and keeps it in its entry)
            recs = [self.samples[sid] for sid in g.sample_ids]
            groups.append({"group_id": g.group_id, "prompt_index": g.prompt.index,
                           "prompt_ids": next((r.prompt_ids for r in recs if r.loss_mask is None), recs[0].prompt_ids)})
            for sid in g.sample_ids:
                r = self.samples[sid]
                if not r.finished or r.replay_pending:  # a pending replay is unfinished for the orchestrator
                    continue
                samples.append({
                    "sample_id": r.sample_id, "reward": r.reward, "output_ids": r.output_ids,
                    "logprobs": r.logprobs, "versions": sorted(r.versions),
                    **({"routed_experts": r.routed_experts} if r.routed_experts is not None else {}),
                    **({"finish_reason": r.finish_reason} if r.finish_reason is not None else {}),
                    # a workflow's trajectory: its own prompt rendering and which tokens are the model's
                    **({"prompt_ids": r.prompt_ids, "loss_mask": r.loss_mask} if r.loss_mask is not None else {}),
                })
        # the checksums an instance may still load after a resume: the versions of outstanding work
        # and the newest (older ones are never switched to again)
        oldest = min((int(g["version"]) for g in orchestrator_snapshot["groups"]), default=version)
        return {
            "format": 2, "version": version, "pending_step_finished": version,
            "next_prompt": self.next_prompt, "wall_s": self.now(),
            "orchestrator": orchestrator_snapshot,
            "groups": groups, "samples": samples,
            "steps_done": self.steps_done,
            "metrics": self.metrics.state_dict(), "migrated_bytes": self.migrated_bytes,
            "migrations_done": self.migrations_done, "migrations_fallback": self.migrations_fallback,
            "expected_checksums": {str(k): v for k, v in self.expected_checksums.items() if k >= min(oldest, version)},
        }

    def load_state_dict(self, state: dict[str, Any], step_rows: Sequence[dict[str, Any]] = ()) -> None:
        """Continue from :meth:`state_dict`: unfinished samples of unconsumed groups are re-run on
        their own version; every instance is fresh and is switched to the version it is given.
        ``step_rows``: the metrics recorder's rows of the steps done, as ``steps.jsonl`` has them
        (:func:`~dora_megatron.observability.recorder.read_step_rows`; the summary of the resumed
        run covers the whole run)."""
        self.next_prompt = int(state["next_prompt"])
        self._wall_offset = float(state["wall_s"])
        # a group's version and sample ids, a sample's version: the orchestrator snapshot's (an older
        # controller.json also has them in its own entries, and the prompt ids in every sample entry)
        orch_groups = {g["group_id"]: g for g in state["orchestrator"]["groups"]}
        orch_samples = {s["sample_id"]: s for s in state["orchestrator"]["samples"]}
        for g in state["groups"]:
            og = orch_groups.get(g["group_id"], g)
            prompt = self.source.get(int(g["prompt_index"]))
            sample_ids = tuple(g.get("sample_ids", og["sample_ids"]))
            version = int(g.get("version", og["version"]))
            self.groups[g["group_id"]] = GroupRecord(g["group_id"], version, prompt, sample_ids, 0.0)
            for i, sid in enumerate(sample_ids):
                self.samples[sid] = SampleRecord(sid, g["group_id"], i, int(orch_samples.get(sid, og).get("version", version)),
                                                 list(g.get("prompt_ids") or ()))
        for d in state["samples"]:
            rec = self.samples[d["sample_id"]]
            if "prompt_ids" in d:  # an older controller.json: the prompt ids in every sample entry
                rec.prompt_ids = list(d["prompt_ids"])
            if "version" in d:  # an older controller.json: every sample, with its version
                rec.version = int(d["version"])
            if not d.get("finished", True):
                continue
            rec.output_ids, rec.logprobs = list(d["output_ids"]), list(d["logprobs"])
            rec.versions, rec.reward, rec.finished = set(d["versions"]), d["reward"], True
            rec.routed_experts, rec.finish_reason = d.get("routed_experts"), d.get("finish_reason")
            rec.loss_mask = d.get("loss_mask")
        # consumed groups are not carried (consumed.jsonl lists them; an older controller.json's
        # "consumed" is ignored): the restored orchestrator has forgotten them, so none can be
        # released again
        # the step logs themselves are steps.jsonl's (an older controller.json's "steps" list: its length)
        self.steps_done = int(state["steps_done"]) if "steps_done" in state else len(state["steps"])
        if "metrics" in state:  # absent in checkpoints written before the recorder: the summary then starts anew
            self.metrics.load_state_dict(state["metrics"], rows=step_rows)
        self.migrated_bytes = int(state["migrated_bytes"])
        self.migrations_done = int(state["migrations_done"])
        self.migrations_fallback = int(state["migrations_fallback"])
        self.expected_checksums = {int(k): v for k, v in state["expected_checksums"].items()}
        self._pending_step_finished = state.get("pending_step_finished")
        self.latest_version = int(state["version"])
        # an older controller.json also holds "c1_count"/"duplicated": ignored, the C1 and
        # duplicate counts of a run are the orchestrator's (its snapshot carries them)
        self._resumed = True

    # ------------------------------------------------------------------ main loop
    async def _poll_stats(self, iid: str, engine: Engine, slots: asyncio.Semaphore) -> None:
        """One instance's load report, applied as soon as it arrives. ``health_timeout_s`` bounds
        the call itself, not the wait for a polling slot: a long sweep must not fail healthy instances.

        A timeout is confirmed by a second poll before the instance is failed: the answer of a
        healthy instance can sit unread while the controller's own loop lags (seconds at 1,024
        fake instances on a loaded machine, tools/controller_scale.py), and one late timer would
        then fail it. Errors (refused connection, HTTP error) fail it at once."""
        async with slots:
            for attempt in (1, 2):
                if self.is_failed(iid) or self.engines.get(iid) is not engine:
                    return
                try:
                    info = await asyncio.wait_for(engine.server_info(), timeout=self.opt.health_timeout_s)
                    break
                except asyncio.TimeoutError:
                    if attempt == 2:
                        self.events.post(InstanceFailed(
                            iid, f"server_info did not answer within {self.opt.health_timeout_s:g} s "
                                 "(controller.health_timeout_s), twice in a row", engine))
                        return
                    log.info("stats poll of %s timed out; asking again before failing it", iid)
                except Exception as err:  # noqa: BLE001 - unreachable engine = failed engine
                    if _is_local(err):  # the controller's shortage: this sweep goes without its report
                        self._local_shortage(f"stats poll of {iid}", err)
                        return
                    self.events.post(InstanceFailed(iid, f"server_info failed: {err}", engine))
                    return
        self._apply_load(iid, engine, info)

    def _apply_load(self, iid: str, engine: Engine, info: dict[str, Any]) -> None:
        if self.is_failed(iid) or self.engines.get(iid) is not engine:
            return  # failed or replaced while we asked
        if info.get("loads_unavailable"):
            return  # alive, but it reports no loads (no /v1/loads): the orchestrator's own count stands
        running = int(info.get("num_running_reqs", info.get("running", 0)) or 0)
        kv = float(info.get("kv_usage", info.get("token_usage", 0.0)) or 0.0)
        if "spec_verify_steps" in info:
            self.spec_stats[iid] = info
        self.events.post(InstanceStats(iid, running, kv, engine))  # the loop drops it if failed/replaced meanwhile

    async def _apply_reports(self, reports: dict[Any, Any], chunk: int = 128) -> None:
        """Pushed load reports, ``chunk`` per event-loop turn: thousands of instances in one turn
        would stall every request's completion behind them."""
        names = {id(e): iid for iid, e in self.engines.items()}
        for n, (engine, info) in enumerate(reports.items(), 1):
            iid = names.get(id(engine))
            if iid is None:
                continue
            if isinstance(info, tuple) and info and info[0] == "failed":
                self.events.post(InstanceFailed(iid, str(info[1]), engine))
            else:
                self._apply_load(iid, engine, info)
            if n % chunk == 0:
                await asyncio.sleep(0)

    async def _stats_loop(self) -> None:
        """Event source (the one place stats are polled): every ``stats_interval_s``, one sweep over
        every live instance, then a :class:`Tick`. WHY concurrent (at most
        ``stats_concurrency`` calls in flight): asked one after the other, a sweep takes N round
        trips, so at a few hundred instances the load the orchestrator decides on is seconds old
        (tools/controller_scale.py measured a 6 s poll interval at 256 instances)."""
        slots = asyncio.Semaphore(max(1, self.opt.stats_concurrency))
        while not self._done.is_set():
            pushed = self.load_reports
            if pushed is not None:
                await self._apply_reports(pushed.take_reports())
            polls = [self._poll_stats(iid, engine, slots) for iid, engine in list(self.engines.items())
                     if not self.is_failed(iid)  # instances may join meanwhile
                     and (pushed is None or not pushed.covers(engine))]
            if polls:
                await asyncio.gather(*polls)
            self.events.post(Tick())
            try:
                await asyncio.wait_for(self._done.wait(), timeout=self.opt.stats_interval_s)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> dict[str, Any]:
        """Run the :class:`~dora_megatron.controller.loop.ControllerLoop` until the last step (or an
        error); returns the summary."""
        self._t0 = time.monotonic()
        self._trainer_idle_since = self._wall_offset
        for iid in self.engines:
            self.metrics.instance_joined(iid, self.now())
        for iid, why in self.absent_at_start.items():  # before Start / Resume: never given work
            self.events.post(InstanceFailed(iid, f"not ready when the job started: {why}"))
        if self.timeline is not None:
            start = self.now()  # a resumed run starts at the checkpoint's wall time, not at 0
            if self._resumed and start > 0:
                self.timeline.span("trainer", "before the resume (previous run)", 0.0, start, kind="resumed")
            for iid, v in self._version_of.items():
                self.timeline.set_version(iid, v, start)
        if self._resumed and self.steps_done >= self.opt.steps:
            # every step was done before the checkpoint: nothing to dispatch, and no
            # on_step_finished will ever come to end the run
            self._done.set()
        elif self._resumed:
            self._trainer_idle_since = self.now()
            pending = self._pending_step_finished if self.steps_done < self.opt.steps else None
            self.events.post(Resume(tuple(i for i in self.engines if i not in self.absent_at_start), pending))
        else:
            self.events.post(Start())
        loop = ControllerLoop(self.orch, self, self.events, self._done)
        stats = asyncio.get_running_loop().create_task(self._stats_loop())
        watch = asyncio.get_running_loop().create_task(self._wake_on_done())
        try:
            await loop.run()
        except Exception as err:  # noqa: BLE001 - a failed event handler stops the run with its cause
            log.exception("controller loop failed")
            if self._error is None:
                self._error = err
        finally:
            stats.cancel()
            watch.cancel()
            await asyncio.gather(stats, watch, return_exceptions=True)
        if self._error is not None:
            if self.evaluator is not None:
                self.evaluator.cancel()
            await self._cancel_all()
            raise self._error
        wall = self.now()
        await self._cancel_all()
        if self.timeline is not None:
            self.timeline.close(wall)
        if self.evaluator is not None and self.stop_reason is None:  # the final weights, once the rollout stopped (not in the run's wall time; not on a stop)
            await self.evaluator.finish(self.steps_done, self.latest_version or max(self._version_of.values(), default=0))
        return self.summary(wall)

    async def _wake_on_done(self) -> None:
        """The run may be ended from outside the loop (a supervisor sets ``_done``): wake the loop."""
        await self._done.wait()
        self.events.post(Stop())

    async def _cancel_all(self) -> None:
        """Abort what is still generating (outstanding groups of the next steps) and stop tasks.
        Every instance at once: one after the other, 4,096 instances took minutes to stop."""
        async def abort_all(engine: Engine) -> None:
            try:
                await asyncio.wait_for(engine.abort(abort_all=True), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

        await asyncio.gather(*(abort_all(e) for iid, e in list(self.engines.items()) if not self.is_failed(iid)))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ summary
    def summary(self, wall: float) -> dict[str, Any]:
        """The recorder's metrics, then facts of this run only the runtime knows (instances, checksums)."""
        osum = self.orch.summary()
        totals = RunTotals(
            dispatched_groups=osum["dispatched_groups"], consumed_groups=osum["consumed_groups"],
            lost_groups=osum["lost_groups"], duplicated_groups=osum["duplicated_groups"],
            c1_violations=osum["c1_violations"], c3_violations=osum["c3_violations"],
            migrations=osum["migrations"], migrated_kv_bytes=self.migrated_bytes,
            reprefill_tokens=osum["reprefill_tokens"])
        out = self.metrics.summary(mode=osum["mode"], max_staleness=osum["max_staleness"], tbs=osum["tbs"],
                                   rbs=osum["rbs"], totals=totals, wall_time_s=wall)
        out["migrations_kv"] = self.migrations_done
        out["migrations_reprefill"] = self.migrations_fallback
        out["checksum_mismatches"] = self.checksum_mismatches
        out["checksum_unavailable"] = len(self.checksum_off)
        out["routed_experts_unavailable"] = len(self.routed_experts_off)
        out["speculation"] = speculation_summary(self.spec_stats.values())
        out["version_refusals"] = self.version_refusals
        out["weight_push_bytes"] = self.pushed_bytes
        out["instances"] = sorted(self.engines)  # every instance that was in the pool (joined ones too)
        out["failed_instances"] = sorted(self.failed_ever)
        out["instances_rejoined"] = self.rejoins
        out["samples_after_rejoin"] = self.samples_after_rejoin
        out["engine_restarts"] = self.engine_restarts
        out["instances_absent_at_start"] = dict(sorted(self.absent_at_start.items()))
        out["weight_sync_timeouts"] = self.weight_sync_timeouts
        out["local_resource_errors"] = self.local_resource_errors
        waits = self.connection_waits
        out["connection_waits"] = waits() if callable(waits) else (waits.count if waits is not None else 0)
        out["samples_from_journal"] = self.samples_from_journal
        out["max_live_versions"] = osum.get("max_live_versions")
        out["outstanding_groups_at_end"] = osum["dispatched_groups"] - osum["consumed_groups"]
        if self.evaluator is not None:
            out.update(self.evaluator.summary())
        if self.workflow is not None:
            out.update(self.workflow.counts)
        # "completed"; "stopped" (a stop request: checkpoint ``stop_checkpoint`` written, ``--resume``
        # goes on from it); "stopped_without_checkpoint" (the step was abandoned: the last complete
        # checkpoint stays)
        out["status"] = ("completed" if self.stop_reason is None or self.steps_done >= self.opt.steps else
                         "stopped" if self.stop_checkpoint is not None else "stopped_without_checkpoint")
        out["stopped_by"] = self.stop_reason
        out["stop_checkpoint"] = self.stop_checkpoint
        return out
