"""Trainer side of SGLang's distributed weight update: group setup, pause, bucketed push, resume.

WHY this order (reference B.2 and pitfalls E.1-E.8):

* **connect**: the weight-update group has the trainer at rank 0 and instance ``i`` at
  ``rank_offset = 1 + sum(gpus of instances before i)`` (each TP rank of an instance joins at
  ``rank_offset + tp_rank``), ``world_size = 1 + sum(gpus)``. Every ``/init_weights_update_group``
  request is sent *first*, then the trainer builds its side (``PrefixStore(group_name)`` +
  ``_new_process_group_helper``, the layout SGLang uses), then the HTTP answers are awaited:
  either side alone blocks forever.
* **push(version)**: ``/pause_generation`` with the configured mode; then per bucket (HF names,
  at most ``bucket_mb``, planned by :func:`dora_megatron.weights.plan.plan_buckets`, the planner
  every transport shares) one ``/update_weights_from_distributed`` per instance, sent before the
  broadcast of the bucket's tensors (in ``names`` order, from a worker thread so the HTTP answers,
  which carry errors and have timeouts, stay on the event loop); then ``/continue_generation``.
  ``weight_version`` travels inside every update request (never ``/update_weight_version``, which
  aborts everything by default) and ``abort_all_requests`` stays false (the pause did the work).
* **flush_cache**: SGLang flushes the radix cache after an update with ``flush_cache=true`` and
  asserts the flush succeeded, which it cannot while requests are running or waiting. After an
  ``abort`` pause the instance is empty: only the last bucket asks for the flush (once, after all
  weights are in). After ``retract``/``in_place`` requests are still held: no bucket asks for it,
  and the KV those requests computed under the old weights stays in use (a sample then spans two
  versions: only acceptable in ``partial`` mode, which records it).
* A failed request means the instance's weights are partially updated: :class:`WeightPushFailed`
  names those instances so the caller removes them (they are not resumed).

The same calls work against the embedded engine (gloo on CPU), which is how this is tested.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

log = logging.getLogger(__name__)


class UpdateTarget(Protocol):
    """The instance calls a push needs (:class:`~dora_megatron.rollout.sglang.client.SGLangClient`)."""

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str = ..., backend: str = ...) -> dict[str, Any]: ...
    async def destroy_weights_update_group(self, group_name: str = ...) -> dict[str, Any]: ...
    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name=..., weight_version=None, *,
                                              flush_cache: bool = True, abort_all_requests: bool = False) -> dict[str, Any]: ...
    async def pause(self, mode: str = "abort") -> dict[str, Any]: ...
    async def continue_generation(self) -> dict[str, Any]: ...
    async def weight_version(self) -> str: ...


class WeightPushFailed(RuntimeError):
    def __init__(self, failed: dict[str, str]) -> None:
        super().__init__("weight update failed (weights partially updated, discard these instances): "
                         + "; ".join(f"{k}: {v}" for k, v in sorted(failed.items())))
        self.failed = failed


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


def bucket_flags(pause_mode: str, last: bool) -> dict[str, bool]:
    """``flush_cache`` / ``abort_all_requests`` of one bucket's update request (see module doc)."""
    if pause_mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"unknown pause mode {pause_mode!r}")
    return {"flush_cache": pause_mode == "abort" and last, "abort_all_requests": False}


@dataclass
class PushReport:
    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    paused: dict[str, Any] = field(default_factory=dict)


class DistributedWeightPusher:
    """One weight-update group from this trainer rank to a fixed set of instances.

    Membership is fixed per group (``world_size`` is part of the rendezvous): when instances join or
    leave, :meth:`disconnect` and build a new pusher (as slime's ``reconnect``)."""

    def __init__(self, targets: Mapping[str, UpdateTarget], gpus: Mapping[str, int], *, master_address: str,
                 master_port: int, group_name: str = "dora_weights", backend: str = "nccl",
                 pause_mode: str = "abort", bucket_mb: float = 512, timeout_s: float = 600.0) -> None:
        if set(targets) != set(gpus):
            raise ValueError("targets and gpus must name the same instances")
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
        self.group: Any = None

    async def connect(self) -> None:
        from dora_megatron.rollout.engine import weight_sync

        calls = [asyncio.ensure_future(t.init_weights_update_group(self.master_address, self.master_port, off,
                                                                   self.layout.world_size, self.group_name, self.backend))
                 for t, off in zip(self.targets.values(), self.layout.rank_offsets)]
        own = asyncio.ensure_future(asyncio.to_thread(
            weight_sync.init_weight_update_group, self.master_address, self.master_port, 0, self.layout.world_size,
            self.group_name, self.backend, self.timeout_s))
        results = await asyncio.gather(own, *calls, return_exceptions=True)
        failed = {n: repr(r) for n, r in zip(self.targets, results[1:]) if isinstance(r, BaseException)}
        if isinstance(results[0], BaseException):
            raise RuntimeError(f"trainer side of {self.group_name} failed: {results[0]!r}; instances: {failed}")
        self.group = results[0]
        if failed:
            raise WeightPushFailed(failed)
        log.info("weight-update group %s: world %d over %d instances", self.group_name, self.layout.world_size,
                 len(self.targets))

    async def disconnect(self) -> None:
        from dora_megatron.rollout.engine import weight_sync

        await asyncio.gather(*(t.destroy_weights_update_group(self.group_name) for t in self.targets.values()),
                             return_exceptions=True)
        if self.group is not None:
            weight_sync.destroy_weight_update_group(self.group)
            self.group = None

    async def push(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> PushReport:
        """Send every ``(hf_name, tensor)`` as weights ``version`` to every instance."""
        import time

        from dora_megatron.rollout.engine import weight_sync

        if self.group is None:
            raise RuntimeError("push before connect")
        t0 = time.monotonic()
        from dora_megatron.weights.plan import plan_buckets, spec_of

        by_name = {n: t.contiguous() for n, t in named_tensors}
        buckets = plan_buckets([spec_of(n, t) for n, t in by_name.items()], self.bucket_mb)
        names = list(self.targets)
        paused = dict(zip(names, await asyncio.gather(*(t.pause(self.pause_mode) for t in self.targets.values()))))
        failed: dict[str, str] = {}
        for b in buckets:
            flags = bucket_flags(self.pause_mode, last=b.index == len(buckets) - 1)
            posts = [asyncio.ensure_future(t.update_weights_from_distributed(
                b.names, b.dtypes, b.shapes, group_name=self.group_name, weight_version=str(version), **flags))
                for t in self.targets.values()]
            send = asyncio.to_thread(weight_sync.send_tensors, self.group, [by_name[n] for n in b.names])
            results = await asyncio.gather(send, *posts, return_exceptions=True)
            if isinstance(results[0], BaseException):
                raise WeightPushFailed({n: f"broadcast failed: {results[0]!r}" for n in names})
            failed.update({n: repr(r) for n, r in zip(names, results[1:]) if isinstance(r, BaseException)})
            if failed:
                break  # the collective order is broken for the failed ones: stop here
        if failed:
            raise WeightPushFailed(failed)
        got = dict(zip(names, await asyncio.gather(*(t.weight_version() for t in self.targets.values()))))
        wrong = {n: f"reports weight_version {v!r} after pushing {version}" for n, v in got.items() if v != str(version)}
        if wrong:
            raise WeightPushFailed(wrong)
        await asyncio.gather(*(t.continue_generation() for t in self.targets.values()))
        return PushReport(version, len(buckets), len(by_name), sum(b.nbytes for b in buckets), time.monotonic() - t0,
                          paused)
