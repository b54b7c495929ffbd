"""Trainer side of SGLang's distributed weight update: group setup, pause, bucketed push, resume.

The one implementation of the ``distributed`` transport: the trainer's ``/push_weights``
(:func:`dora_megatron.weights.transport.push_distributed`, one group per push) and long-lived
groups (a pusher kept connected across versions, as slime does) both run through
:class:`DistributedWeightPusher`, against SGLang and the embedded engine alike (gloo on CPU, which
is how it is tested; NCCL on CUDA).

WHY this order (reference B.2 and pitfalls E.1-E.8):

* **connect**: the weight-update group has the trainer at rank 0 and instance ``i`` at
  ``rank_offset = 1 + sum(gpus of instances before i)`` (each TP rank of an instance joins at
  ``rank_offset + tp_rank``), ``world_size = 1 + sum(gpus)``. Every ``/init_weights_update_group``
  request is sent *first*, then the trainer builds its side (``PrefixStore(group_name)`` +
  ``_new_process_group_helper``, the layout SGLang uses), then the HTTP answers are awaited:
  either side alone blocks forever.
* **push(version)**: ``/pause_generation`` with the configured mode (none: the caller pushes only
  to instances it drained, as the DORA runtime does); ``/begin_weight_update`` (SGLang >= 0.5.22
  refuses ``/update_weights_from_distributed`` outside such a session, weight_updater.py); then
  per bucket (HF names, at most ``bucket_mb``, planned by
  :func:`dora_megatron.weights.plan.plan_buckets`, the planner every transport shares, which keeps
  the tensors SGLang loads only together in one bucket: :func:`~dora_megatron.weights.naming.load_together`) one
  ``/update_weights_from_distributed`` per instance, sent before the broadcast of the bucket's
  tensors (in ``names`` order, from a worker thread so the HTTP answers, which carry errors and
  have timeouts, stay on the event loop); then ``/end_weight_update`` and
  ``/continue_generation``. ``weight_version`` travels with the *last* bucket only (SGLang sets
  the version on every successful update call, so a push failing halfway would otherwise leave the
  instance reporting the new version on mixed weights); never ``/update_weight_version``, which
  aborts everything by default. ``abort_all_requests`` stays false (the pause did the work).
* **flush_cache**: SGLang flushes the radix cache after an update with ``flush_cache=true`` and
  fails the update when the flush is refused, which it is while requests run (or wait, unless
  generation is paused; scheduler.py ``flush_cache``). After an ``abort`` pause (or with no pause,
  on a drained instance) the instance is empty, after ``retract`` its requests wait in the queue
  with their KV freed: the last bucket asks for the flush (once, after all weights are in), so no
  request reuses prefix KV the old weights computed. After ``in_place`` the requests keep running
  on the old KV (SGLang's documented semantics): no bucket asks for it; a sample then spans two
  versions, which ``meta_info.weight_versions`` reports and the runtime records.
* **failure**: an engine that rejects a bucket (unknown names, wrong shapes) answers before
  receiving, so the broadcast to it cannot complete; the trainer's broadcast then fails after
  ``timeout_s`` (gloo/NCCL collectives cannot be cancelled). :class:`PushError` names the engines
  and their messages. Every exit path closes the sessions it opened and resumes the instances it
  paused (a paused SGLang instance holds every later ``/generate``, and a disk update does not
  clear the pause); their weights may be mixed but they still report the old version, so the
  caller loads a whole version (the runtime: the snapshot) before routing work to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

from dora_megatron.comm.engine_client import probe_unavailable
from dora_megatron.comm.json_value import JSONObject
from dora_megatron.comm.protocol import PAUSE_MODES
from dora_megatron.weights import naming
from dora_megatron.weights.plan import Bucket, plan_buckets, spec_of
from dora_megatron.weights.results import PushError, PushResult, failures

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


class UpdateTarget(Protocol):
    """The instance calls a push needs (:class:`~dora_megatron.comm.sglang_client.SGLangClient`)."""

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str = ..., backend: str = ...) -> JSONObject: ...
    async def destroy_weights_update_group(self, group_name: str = ...) -> JSONObject: ...
    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str = ...,
                                              weight_version: int | str | None = None, *, flush_cache: bool = True,
                                              abort_all_requests: bool = False) -> JSONObject: ...
    async def begin_weight_update(self) -> JSONObject: ...
    async def end_weight_update(self) -> JSONObject: ...
    async def pause(self, mode: str = "abort") -> JSONObject: ...
    async def continue_generation(self) -> JSONObject: ...
    async def weight_version(self) -> str: ...


def push_buckets(tensors: Mapping[str, torch.Tensor], bucket_mb: float) -> list[Bucket]:
    """The buckets of a push of ``tensors`` (HF name -> tensor, in export order): at most
    ``bucket_mb`` MiB each, the tensors an engine loads only together (MLA's ``q_a_proj`` and
    ``kv_a_proj_with_mqa``, :func:`~dora_megatron.weights.naming.load_together`) in one."""
    return plan_buckets([spec_of(n, t) for n, t in tensors.items()], bucket_mb, naming.load_together)


@dataclass(frozen=True)
class GroupLayout:
    names: tuple[str, ...]
    rank_offsets: tuple[int, ...]
    world_size: int

    def ranks_of(self, name: str, gpus: int) -> range:
        off = self.rank_offsets[self.names.index(name)]
        return range(off, off + gpus)


def group_layout(gpus: Mapping[str, int]) -> GroupLayout:
    """Trainer rank 0, then each instance's GPUs as consecutive ranks, in the mapping's order."""
    offsets, nxt = [], 1
    for name, n in gpus.items():
        if n < 1:
            raise ValueError(f"{name}: an instance has at least one GPU, got {n}")
        offsets.append(nxt)
        nxt += n
    return GroupLayout(tuple(gpus), tuple(offsets), nxt)


def bucket_flags(pause_mode: str | None, last: bool) -> dict[str, bool]:
    """``flush_cache`` / ``abort_all_requests`` of one bucket's update request (see module doc);
    ``pause_mode`` None: the instance was drained by the caller (empty, like after ``abort``)."""
    if pause_mode is not None and pause_mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause mode {pause_mode!r} (expected one of {', '.join(PAUSE_MODES)} or none)")
    return {"flush_cache": pause_mode in (None, "abort", "retract") and last, "abort_all_requests": False}


def pushed_versions(names: list[str], got: Sequence[str | BaseException], version: int | str,
                    warned: set[str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """``(versions, wrong)`` from each target's ``weight_version()`` after a push (``gather`` with
    ``return_exceptions``). A target without a version report (:func:`probe_unavailable`: no
    ``/model_info``) cannot confirm the push, which says nothing against it: it is ``"unverified"``
    (one warning per target: ``warned``, the caller's set of targets already warned about, is
    updated), not wrong; any other error, or another version, is wrong."""
    warned = set() if warned is None else warned
    versions: dict[str, str] = {}
    wrong: dict[str, str] = {}
    for n, v in zip(names, got):
        if probe_unavailable(v):
            first = n not in warned
            warned.add(n)
            log.log(logging.WARNING if first else logging.DEBUG,
                    "%s: cannot read its weight_version (%s); pushes are not version-verified there", n, v)
            versions[n] = "unverified"
            continue
        versions[n] = f"error: {v}" if isinstance(v, BaseException) else str(v)
        if versions[n] != str(version):
            wrong[n] = f"reports weight_version {versions[n]!r} after pushing {version}"
    return versions, wrong


class DistributedWeightPusher:
    """One weight-update group from this trainer rank to a fixed set of instances.

    Membership is fixed per group (``world_size`` is part of the rendezvous): when instances join or
    leave, :meth:`disconnect` and build a new pusher (as slime's ``reconnect``). ``gpus``: ranks per
    instance (its TP size; default 1 each). ``timeout_s`` bounds the rendezvous and every broadcast."""

    def __init__(self, targets: Mapping[str, UpdateTarget], gpus: Mapping[str, int] | None = None, *,
                 master_address: str, master_port: int, group_name: str = "dora_weights", backend: str = "nccl",
                 pause_mode: str | None = "abort", bucket_mb: float = 512, timeout_s: float = 600.0) -> None:
        gpus = {n: 1 for n in targets} if gpus is None else dict(gpus)
        if set(targets) != set(gpus):
            raise ValueError(f"targets and gpus must name the same instances: {sorted(targets)} vs {sorted(gpus)}")
        if not targets:
            raise ValueError("no engines to push to")
        bucket_flags(pause_mode, True)  # validates the mode
        self.targets = dict(targets)
        self.layout = group_layout({n: gpus[n] for n in targets})
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.pause_mode = pause_mode
        self.bucket_mb = bucket_mb
        self.timeout_s = timeout_s
        self._unverified_warned: set[str] = set()  # targets told about once: no version report
        self.group: ProcessGroup | None = None
        self.joined: list[str] = []
        self.connect_seconds = 0.0

    async def connect(self) -> None:
        """Form the group; raises :class:`PushError` naming the instances (or ``trainer``) that
        could not join. Call :meth:`disconnect` afterwards either way.

        Fails at the first failure on either side: a group forms only when every rank joins, so
        once one cannot, the others would only wait out their ``timeout_s``. The calls still
        waiting are then cancelled and the trainer's side is left to time out on its own thread
        (its store's port stays taken until then; each push picks a free port and a new name)."""
        from dora_megatron.comm import weight_group

        if weight_group.group_name_in_use(self.group_name):
            raise PushError(f"weight update group {self.group_name} not formed", {
                "trainer": f"this process already has a process group named {self.group_name!r}; "
                           "disconnect the pusher that made it, or name another"})
        t0 = time.perf_counter()
        names = list(self.targets)
        # engines first (they retry connecting to the store), the trainer hosts the rendezvous
        calls = [asyncio.ensure_future(t.init_weights_update_group(self.master_address, self.master_port, off,
                                                                   self.layout.world_size, self.group_name, self.backend))
                 for t, off in zip(self.targets.values(), self.layout.rank_offsets)]
        own = weight_group.in_daemon_thread(lambda: weight_group.init_weight_update_group(
            self.master_address, self.master_port, 0, self.layout.world_size, self.group_name, self.backend,
            self.timeout_s))
        pending: set[asyncio.Future[Any]] = {own, *calls}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(f.exception() is not None for f in done):
                break
        for f in pending:
            f.cancel()
        if pending:
            await asyncio.wait(pending)  # the cancelled HTTP calls settle (own is abandoned at once)
        errors: dict[str, str] = {}
        self.joined = []
        for name, c in zip(names, calls):
            if c.cancelled():
                errors[name] = "gave up waiting: another rank could not join"
            elif (exc := c.exception()) is not None:
                errors[name] = f"{type(exc).__name__}: {exc}"
            else:
                self.joined.append(name)
        if own.cancelled() or (own_exc := own.exception()) is not None:
            if not own.cancelled():
                errors["trainer"] = f"{type(own_exc).__name__}: {own_exc}"
            raise PushError(f"weight update group {self.group_name} not formed", errors)
        self.group = own.result()
        if errors:
            raise PushError(f"weight update group {self.group_name} not formed", errors)
        self.connect_seconds = time.perf_counter() - t0
        log.info("weight-update group %s: world %d over %d instances", self.group_name, self.layout.world_size,
                 len(self.targets))

    async def disconnect(self) -> None:
        """Destroy the group on the instances that joined it and on this side (best effort)."""
        from dora_megatron.comm import weight_group

        gone = await asyncio.gather(*(self.targets[n].destroy_weights_update_group(self.group_name)
                                      for n in self.joined), return_exceptions=True)
        for name, err in zip(self.joined, gone):
            if isinstance(err, BaseException):
                log.warning("%s: destroy_weights_update_group %s: %s", name, self.group_name, err)
        self.joined = []
        if self.group is not None:
            try:
                weight_group.destroy_weight_update_group(self.group)
            except Exception:  # noqa: BLE001 - best effort
                log.warning("could not destroy the trainer side of %s", self.group_name, exc_info=True)
            self.group = None

    async def _end_sessions(self, names: list[str]) -> dict[str, str]:
        """``/end_weight_update`` on ``names``; returns the failures (logged)."""
        res = await asyncio.gather(*(self.targets[n].end_weight_update() for n in names), return_exceptions=True)
        errors = failures(names, res)
        for name, err in errors.items():
            log.error("%s: end_weight_update failed: %s", name, err)
        return errors

    async def push(self, version: int | str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PushResult:
        """Send every ``(hf_name, tensor)`` as weights ``version`` to every instance."""
        from dora_megatron.comm import weight_group

        if self.group is None:
            raise RuntimeError("push before connect")
        t0 = time.perf_counter()
        by_name = {n: t.detach().contiguous() for n, t in named_tensors}
        if self.backend == "gloo":
            by_name = {n: t.cpu() for n, t in by_name.items()}
        buckets = push_buckets(by_name, self.bucket_mb)
        names = list(self.targets)
        paused: dict[str, JSONObject] = {}
        opened: list[str] = []
        try:
            if self.pause_mode is not None:
                res = await asyncio.gather(*(t.pause(self.pause_mode) for t in self.targets.values()),
                                           return_exceptions=True)
                if errors := failures(names, res):
                    raise PushError("pause_generation failed", errors)
                paused = {n: r for n, r in zip(names, res) if not isinstance(r, BaseException)}  # all of them
            res = await asyncio.gather(*(t.begin_weight_update() for t in self.targets.values()), return_exceptions=True)
            opened = [n for n, r in zip(names, res) if not isinstance(r, BaseException)]
            if errors := failures(names, res):
                raise PushError("begin_weight_update failed", errors)
            for b in buckets:
                last = b.index == len(buckets) - 1
                flags = bucket_flags(self.pause_mode, last=last)
                posts = [asyncio.ensure_future(t.update_weights_from_distributed(
                    b.names, b.dtypes, b.shapes, group_name=self.group_name,
                    weight_version=str(version) if last else None, **flags))
                    for t in self.targets.values()]
                send = asyncio.to_thread(weight_group.send_tensors, self.group, [by_name[n] for n in b.names])
                results = await asyncio.gather(send, *posts, return_exceptions=True)
                errors = failures(names, results[1:])
                if isinstance(results[0], BaseException):
                    errors["trainer"] = f"broadcast failed: {type(results[0]).__name__}: {str(results[0])[:200]}"
                if errors:  # the collective order is broken for the failed ones: stop here
                    raise PushError(f"bucket {b.index + 1}/{len(buckets)} ({len(b.names)} tensors) not delivered", errors)
            ended, opened = await self._end_sessions(opened), []
            if ended:
                raise PushError("end_weight_update failed", ended)
            got = await asyncio.gather(*(t.weight_version() for t in self.targets.values()), return_exceptions=True)
            versions, wrong = pushed_versions(names, got, version, self._unverified_warned)
            if wrong:
                raise PushError("weights not taken", wrong)
        finally:  # every exit path: close the sessions opened, resume what was paused
            if opened:
                await self._end_sessions(opened)
            if self.pause_mode is not None:
                res = await asyncio.gather(*(t.continue_generation() for t in self.targets.values()),
                                           return_exceptions=True)
                for name, err in failures(names, res).items():
                    log.error("%s: continue_generation after the push failed: %s", name, err)
        return PushResult("distributed", version, sum(b.nbytes for b in buckets), time.perf_counter() - t0,
                          num_tensors=len(by_name), num_buckets=len(buckets), connect_seconds=self.connect_seconds,
                          versions=versions, group_name=self.group_name, paused=paused)
