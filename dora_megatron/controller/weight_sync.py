"""Weight sync: switching instances between weight versions, checking what they loaded, and the
``distributed`` push (one trainer broadcast to several instances).

WHY a component of its own: a switch is the longest and most failure-prone operation of the
controller (it waits for the moves off and onto the instance, loads, verifies a checksum, may
fall back from the broadcast to the snapshot), and it owns the state only switches need: which
switch order of an instance is the newest, the version each instance serves, the checksums each
version must show. The executor (:class:`~dora_megatron.controller.runtime.Runtime`) only hands
it :class:`~dora_megatron.orchestrator.SwitchVersion` actions; what happened goes on the event
queue (:class:`~dora_megatron.events.SwitchDone`, :class:`InstanceFailed`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from dora_megatron.controller.errors import LOCAL_RETRY_S, is_comm_error as _is_comm_error, is_local as _is_local
from dora_megatron.events import InstanceFailed, SwitchDone
from dora_megatron.controller.loop import EventQueue
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.controller.records import Engine, RunPaths, Trainer
from dora_megatron.controller.run_tasks import RunTasks
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.observability.recorder import MetricsRecorder
from dora_megatron.orchestrator import SwitchVersion

if TYPE_CHECKING:
    from dora_megatron.controller.evaluation import Evaluator
    from dora_megatron.controller.generation import Generation
    from dora_megatron.controller.migration import Migrations
    from dora_megatron.controller.pool import Pool
    from dora_megatron.observability.timeline import Timeline

log = logging.getLogger(__name__)


class WeightSync:
    """Carries out :class:`SwitchVersion` actions (DESIGN section 8).
    ``controller``: the config's section (``weight_transport``, ``weight_sync_timeout_s``,
    ``verify_checksums``); ``paths``: where each version's snapshot is; ``push``: the fields of a
    ``distributed`` broadcast (built from several sections by the launcher). A switch waits for
    the ``moves`` onto and off its instance, skips an instance the ``pool`` failed, counts local
    shortages with ``generation``; ``trainer`` pushes a broadcast; ``tasks``: the clock, one task
    per switch; ``timeline`` (None: none). The eval rounds, built after it, come through
    :meth:`use_evaluator`."""

    def __init__(self, controller: ControllerConfig, paths: RunPaths, push: PushOptions, *,
                 engines: dict[str, Engine], events: EventQueue, metrics: MetricsRecorder, trainer: Trainer,
                 pool: Pool, moves: Migrations, generation: Generation, tasks: RunTasks,
                 timeline: Timeline | None) -> None:
        self.engines = engines
        self.events = events
        self.metrics = metrics
        self.trainer = trainer
        self.pool = pool
        self.moves = moves
        self.generation = generation
        self.tasks = tasks
        self.timeline = timeline
        #: the eval rounds (``data.eval_path``): a switch first sends their requests away (None: no eval set)
        self.evaluator: Evaluator | None = None
        self.controller = controller
        self.paths = paths
        self.push = push
        self.checksum_mismatches = 0
        #: instances whose weights check cannot run (no ``/weights_checker``, no checksum action):
        #: the check is off for them, after one warning each; only a checksum that differs fails one
        self.checksum_off: set[str] = set()
        self.weight_sync_timeouts = 0
        self.expected_checksums: dict[int, str] = {}
        #: version -> SGLang's own checksum of it (``/weights_checker``), as the first instance that
        #: loaded it reported: SGLang's checksum is comparable between instances only
        self.instance_checksums: dict[int, str] = {}
        #: instance -> the task of its newest switch order (loads on one instance run in order; an
        #: older order sees it is superseded). The version an instance serves or is switching to is
        #: the orchestrator's (``Instance.version`` / ``Instance.target``), not kept here.
        self._orders: dict[str, asyncio.Task[None]] = {}
        self._pushes: list[SwitchVersion] = []  # collected by order within one execute
        #: the weights the trainer holds now (what a ``distributed`` push sends). Not the
        #: orchestrator's ``newest``: from the trainer's answer until ``on_step_finished`` (a
        #: checkpoint's trainer part is written in between) the trainer already holds the next
        #: version while the orchestrator may still order switches to the one before, which must
        #: then load from disk, not from a broadcast of the newer weights.
        self.latest_version = 0
        self.pushed_bytes = 0

    def use_evaluator(self, evaluator: Evaluator) -> None:
        """The eval rounds whose requests a switch first sends away.

        WHY after construction: the two need each other. The :class:`~dora_megatron.controller.evaluation.Evaluator`
        loads the final round's weights through this component (:meth:`load_weights`), so it is
        built after it, and handed here once it exists."""
        self.evaluator = evaluator

    def trained(self, version: int, checksum: str | None) -> None:
        """The trainer now holds ``version`` (what a push sends); ``checksum``: what instances that
        load it must show (None: the trainer computed none)."""
        self.latest_version = version
        if checksum:
            self.expected_checksums[version] = checksum

    def order(self, a: SwitchVersion) -> None:
        """One switch action. Switches to the weights the trainer still holds (``distributed``
        transport) are only collected here: :meth:`flush` broadcasts them once per orchestrator answer."""
        if self.controller.weight_transport == "distributed" and a.version == self.latest_version and a.version > 0:
            self._pushes.append(a)  # the trainer still holds these weights: broadcast them once (flush)
            return
        prev = self._orders.get(a.instance)  # loads on one instance run in order
        self._orders[a.instance] = self.tasks.spawn(self.switch(a, prev, self.engines[a.instance]),
                                                   f"switch-{a.instance}")

    def flush(self) -> None:
        """After one orchestrator answer: the collected pushes, as one broadcast."""
        pushes, self._pushes = self._pushes, []
        if pushes:
            prevs = {a.instance: self._orders.get(a.instance) for a in pushes}
            task = self.tasks.spawn(self._push_switch(pushes, prevs), f"push-v{pushes[0].version}")
            for a in pushes:
                self._orders[a.instance] = task

    async def switch(self, a: SwitchVersion, prev: asyncio.Task[Any] | None = None, engine: Engine | None = None,
                      *, resume: bool = False) -> None:
        """``engine``: the instance's client when the switch was ordered (a switch ordered before the
        instance was restarted does not touch its new process). ``resume``: the load follows a
        failed push, which may have left the instance paused; a disk update does not clear
        SGLang's pause (every later ``/generate`` would wait), so generation is continued after it."""
        if prev is not None and not prev.done():
            await asyncio.wait([prev])
        moves = self.moves.pending(a.instance)
        if moves:
            await asyncio.wait(moves)
        if self.evaluator is not None:  # a load waits for running requests: the eval's go elsewhere
            await self.evaluator.vacate([a.instance])
        try:
            if self._superseded(a.instance):
                return
            engine = engine if engine is not None else self.engines[a.instance]
            if self.pool.is_failed(a.instance) or self.engines.get(a.instance) is not engine:
                return  # failed (or replaced) while this switch waited: the orchestrator no longer expects it
            await self._switch_now(a, engine, resume)
        finally:
            if self.evaluator is not None:
                self.evaluator.reopen(a.instance)

    async def _switch_now(self, a: SwitchVersion, engine: Engine, resume: bool) -> None:
        start = self.tasks.now()
        self.metrics.weight_sync_started(a.instance, start, rebalance=a.rebalance)
        try:
            got = await asyncio.wait_for(self._load_weights_retrying(engine, a, resume=resume),
                                         timeout=self.controller.weight_sync_timeout_s)
        except asyncio.TimeoutError:
            self.weight_sync_timeouts += 1
            await self.events.report(InstanceFailed(
                a.instance, f"switch to v{a.version} did not finish within {self.controller.weight_sync_timeout_s:g} s "
                            "(controller.weight_sync_timeout_s)", engine))
            return
        except Exception as err:  # noqa: BLE001 - an instance that cannot load weights is failed
            await self.events.report(InstanceFailed(a.instance, f"switch to v{a.version} failed: {err}", engine))
            return
        finally:
            self.metrics.weight_sync_finished(a.instance, self.tasks.now())
        if got is not None:
            self.checksum_mismatches += 1
            await self.events.report(InstanceFailed(a.instance, got, engine))
            return
        await self.events.report(SwitchDone(a.instance, a.version, engine, start, self.tasks.now()))

    def landed(self, ev: SwitchDone, origin: asyncio.Task[Any] | None) -> bool:
        """Loop (:class:`SwitchDone`): whether the orchestrator is to hear of it. Not when the
        instance failed or was replaced (restarted: its own switch follows) or was re-targeted
        while loading (``origin``, the task that loaded, is no longer its newest switch order:
        that order reports, after loading again)."""
        if self.pool.is_failed(ev.instance) or self.engines.get(ev.instance) is not ev.engine:
            return False
        if self.timeline is not None:  # the time was spent loading, whether or not this order still stands
            self.timeline.span(ev.instance, f"{ev.how} v{ev.version}", ev.start, ev.end, version=ev.version,
                                  kind="weight_sync")
        latest = self._orders.get(ev.instance)
        if origin is not None and latest is not None and latest is not origin:
            return False
        if self.timeline is not None:
            self.timeline.set_version(ev.instance, ev.version, ev.end)
        return True

    def _superseded(self, instance: str) -> bool:
        """True when a newer switch of ``instance`` was ordered after the one running in this task.

        The orchestrator may re-target an instance before its switch ran (v2, then v0, then v2 again);
        only the newest order is carried out. Otherwise the first v2 load would report
        ``on_switch_done(v2)``, the orchestrator would route v2 requests to the instance, and the
        queued v0 load would then replace its weights under those requests."""
        latest = self._orders.get(instance)
        return latest is not None and latest is not asyncio.current_task()

    async def _load_weights_retrying(self, engine: Engine, a: SwitchVersion, *, resume: bool) -> str | None:
        """:meth:`_load_weights`, tried again after a back-off while it fails for a local shortage
        of the controller (bounded by the caller's ``weight_sync_timeout_s``): a load is idempotent."""
        delay = LOCAL_RETRY_S[0]
        while True:
            try:
                return await self.load_weights(engine, a.version, resume=resume, instance=a.instance)
            except Exception as err:  # noqa: BLE001
                if not _is_local(err):
                    raise
                self.generation.local_shortage(f"switch of {a.instance} to v{a.version}", err)
                await asyncio.sleep(delay)
                delay = min(LOCAL_RETRY_S[1], delay * 2)

    async def load_weights(self, engine: Engine, version: int, *, resume: bool = False,
                            instance: str = "") -> str | None:
        """Load snapshot ``version``; returns why the loaded weights are wrong (checksum), or None."""
        await engine.update_weights_from_disk(self.paths.snapshot_dir(version), weight_version=version)
        if resume and hasattr(engine, "continue_generation"):
            await engine.continue_generation()
        return await self.verify_weights(engine, version, instance)

    async def verify_weights(self, engine: Engine, version: int, instance: str = "") -> str | None:
        """``controller.verify_checksums`` after every load, whatever moved the weights: the
        embedded engine's checksum equals the trainer's export checksum of ``version``; SGLang's
        own (``/weights_checker``) is compared with the one the first instance on ``version``
        reported. Returns the mismatch, or None.

        A check that cannot run on ``instance`` (:class:`ProbeUnavailable`: 404, 405, 501, an
        unsupported-action reply) says nothing about its weights: it is switched off for that
        instance with one warning (``checksum_unavailable`` in the summary), never a failure."""
        from dora_megatron.comm.engine_client import ProbeUnavailable

        key = instance or getattr(engine, "base_url", repr(engine))  # one key for the check and the switch
        if not self.controller.verify_checksums or key in self.checksum_off:
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
        seen: str | None = await instance_checksum() if instance_checksum is not None else None
        if seen is None:
            return None
        want = self.instance_checksums.setdefault(version, seen)
        return None if seen == want else (f"weights checksum mismatch for version {version}: /weights_checker "
                                          f"{seen[:16]}, other instances on it {want[:16]}")

    async def _push_switch(self, actions: list[SwitchVersion], prevs: dict[str, asyncio.Task[Any] | None]) -> None:
        """Switch several instances to the newest version with one trainer broadcast (W1 `distributed`).

        Falls back to the per-version snapshot (disk) for every instance if the broadcast fails."""
        waits: list[asyncio.Future[Any]] = [t for t in prevs.values() if t is not None and not t.done()]
        waits += [t for a in actions for t in self.moves.pending(a.instance)]
        if waits:
            await asyncio.wait(waits)
        live = [a for a in actions if not self.pool.is_failed(a.instance) and not self._superseded(a.instance)]
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
        start = self.tasks.now()
        broadcast = self.metrics.trainer_sync_started(start)
        for a in live:
            self.metrics.weight_sync_started(a.instance, start, rebalance=a.rebalance)
        try:
            urls = [getattr(self.engines[a.instance], "base_url") for a in live]
            result = await self.trainer.push_weights(urls, timeout_s=self.controller.weight_sync_timeout_s,
                                                     **self.push.request(urls))
        except Exception as err:  # noqa: BLE001 - the snapshot path still works
            log.warning("weight broadcast of v%d failed (%s); loading the snapshot instead", live[0].version, err)
            result = None
        finally:
            self.metrics.trainer_sync_finished(broadcast, self.tasks.now())
            if self.timeline is not None:
                self.timeline.span("trainer", f"broadcast v{live[0].version}", start, self.tasks.now(), kind="broadcast")
        pushed = None if result is None else result.get("version")
        if pushed is not None and int(pushed) != live[0].version:
            # the trainer finished another step while this push waited: it sent newer weights than
            # the orchestrator assigned (C1) -- load the assigned version's snapshot instead
            log.info("the trainer sent v%s instead of v%d (it trained on meanwhile); loading the snapshot",
                     pushed, live[0].version)
            result = None
        if result is None:
            for a in live:
                self.metrics.weight_sync_finished(a.instance, self.tasks.now())  # each snapshot load times itself
                await self.switch(a, resume=True)
            return
        if result.get("checksum") and live[0].version not in self.expected_checksums:
            self.expected_checksums[live[0].version] = str(result["checksum"])
        end = self.tasks.now()
        for a in live:
            self.metrics.weight_sync_finished(a.instance, end)
        self.pushed_bytes += int(result.get("bytes", 0))
        engines = {a.instance: self.engines[a.instance] for a in live}
        checks = await asyncio.gather(*(self.verify_weights(engines[a.instance], a.version, a.instance)
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
