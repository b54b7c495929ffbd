"""Trainer-side weight transports to rollout engines: distributed broadcast, disk, peer copy.

WHY: after a training step the new version must reach some rollout instances quickly, the others
later (DORA keeps several versions live). Three ways, all ending with the engine reporting the new
``weight_version`` and a weights checksum equal to the trainer's export checksum:

``distributed`` (:func:`push_distributed`): SGLang's ``/init_weights_update_group`` +
``/update_weights_from_distributed`` (reference B.2). One group per push: the trainer is rank 0 and
engine ``i`` is rank ``i + 1`` (TP=1 engines; an engine with TP=k would take k consecutive ranks).
The engines are asked to join first, concurrently, while the trainer hosts the rendezvous; then
for each bucket of :mod:`dora_megatron.weights.plan` the metadata is POSTed to every engine while
the tensors are broadcast, in ``names`` order; then the group is destroyed on both sides. Gloo on
CPU, NCCL on CUDA.

``disk`` (:func:`push_disk`): every engine loads a snapshot directory written by
:mod:`dora_megatron.weights.snapshots` (``/update_weights_from_disk``).

``peer`` (:func:`push_peer`): an instance that already holds the version serves its weights to
others (``/dora/update_weights_from_peer``), so a late switch to an older live version needs
neither the trainer nor a snapshot.

Failure semantics of the distributed path: an engine that rejects a bucket (unknown names, wrong
shapes) answers before receiving, so the broadcast to it cannot complete; the trainer's broadcast
then fails after ``timeout_s`` (gloo/NCCL collectives cannot be cancelled) and
:class:`PushError` names the engines and their messages. An engine keeps its old weights for any
bucket it did not load completely; an engine whose sender dies mid-bucket gets a
connection-closed error at once and answers 500. Between buckets an engine that is not paused may
run requests on partly updated weights; pass ``pause_mode`` (or pause the instances yourself) when
that matters.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from dora_megatron.weights.plan import plan_buckets, spec_of

log = logging.getLogger(__name__)


class PushError(RuntimeError):
    """A push did not reach every engine; ``errors`` maps engine URL -> message."""

    def __init__(self, message: str, errors: Mapping[str, str]) -> None:
        detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
        super().__init__(f"{message}: {detail}" if detail else message)
        self.errors = dict(errors)


@dataclass
class PushResult:
    """What one push moved and what the engines report afterwards."""

    transport: str
    version: int | str
    bytes: int
    seconds: float
    num_tensors: int = 0
    num_buckets: int = 0
    connect_seconds: float = 0.0
    checksum: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    group_name: str = ""

    @property
    def mb_per_s(self) -> float:
        return self.bytes / (1 << 20) / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {"transport": self.transport, "version": self.version, "bytes": self.bytes, "seconds": self.seconds,
                "num_tensors": self.num_tensors, "num_buckets": self.num_buckets,
                "connect_seconds": self.connect_seconds, "checksum": self.checksum, "versions": self.versions,
                "group_name": self.group_name, "mb_per_s": self.mb_per_s}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the trainer's rendezvous store binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _errors(urls: Sequence[str], results: Sequence[Any]) -> dict[str, str]:
    return {u: f"{type(r).__name__}: {r}" for u, r in zip(urls, results) if isinstance(r, BaseException)}


async def _versions(clients: Sequence[Any]) -> dict[str, str]:
    got = await asyncio.gather(*(c.weight_version() for c in clients), return_exceptions=True)
    return {c.base_url: (str(v) if not isinstance(v, BaseException) else f"error: {v}") for c, v in zip(clients, got)}


async def push_distributed_async(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    engine_urls: Sequence[str],
    bucket_mb: float,
    version: int | str,
    master_addr: str = "127.0.0.1",
    backend: str = "gloo",
    *,
    timeout_s: float = 120.0,
    group_name: str | None = None,
    compute_checksum: bool = True,
    pause_mode: str | None = None,
) -> PushResult:
    """Broadcast HF-named ``tensors`` to every engine in buckets of at most ``bucket_mb`` MiB.

    ``timeout_s`` bounds the group rendezvous and every broadcast (a rejected or dead engine makes
    the push fail after at most that long). ``pause_mode`` (``"abort"``, ``"retract"``,
    ``"in_place"``): pause the engines before the first bucket and continue them after the last.
    Raises :class:`PushError` when any engine failed; returns a :class:`PushResult` otherwise."""
    from dora_megatron.rollout.client import EngineClient
    from dora_megatron.rollout.engine import weight_sync
    from dora_megatron.weights.checksum import weights_checksum

    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    named = [(n, t.detach().contiguous()) for n, t in items]
    if backend == "gloo":
        named = [(n, t.cpu()) for n, t in named]
    buckets = plan_buckets([spec_of(n, t) for n, t in named], bucket_mb)
    urls = [u.rstrip("/") for u in engine_urls]
    if not urls:
        raise ValueError("no engines to push to")
    group = group_name or f"dora-w{version}-{uuid.uuid4().hex[:8]}"
    world = 1 + len(urls)
    port = free_port(master_addr)
    checksum = weights_checksum(dict(named)) if compute_checksum else None
    t0 = time.perf_counter()
    clients = [EngineClient(u, timeout_s=timeout_s + 60) for u in urls]
    trainer_group = None
    joined: list[bool] = [False] * len(urls)
    try:
        if pause_mode is not None:
            res = await asyncio.gather(*(c.pause(pause_mode) for c in clients), return_exceptions=True)
            if _errors(urls, res):
                raise PushError("pause_generation failed", _errors(urls, res))
        # engines first (they retry connecting to the store), the trainer hosts the rendezvous
        joins = [asyncio.create_task(c.init_weights_update_group(master_addr, port, i + 1, world, group, backend))
                 for i, c in enumerate(clients)]
        trainer_join = asyncio.create_task(asyncio.to_thread(
            weight_sync.init_weight_update_group, master_addr, port, 0, world, group, backend, timeout_s))
        join_results = await asyncio.gather(*joins, return_exceptions=True)
        joined = [not isinstance(r, BaseException) for r in join_results]
        try:
            trainer_group = await trainer_join
        except Exception as exc:  # noqa: BLE001 - reported with the engines' reasons
            errs = _errors(urls, join_results) or {"trainer": f"{type(exc).__name__}: {exc}"}
            raise PushError(f"weight update group {group} not formed", errs) from None
        if not all(joined):
            raise PushError(f"weight update group {group} not formed", _errors(urls, join_results))
        connect_s = time.perf_counter() - t0
        total = 0
        by_name = dict(named)
        for b in buckets:
            payload = [by_name[n] for n in b.names]
            posts = [asyncio.create_task(c.update_weights_from_distributed(
                b.names, b.dtypes, b.shapes, group_name=group, weight_version=version)) for c in clients]
            send = asyncio.create_task(asyncio.to_thread(weight_sync.send_tensors, trainer_group, payload))
            results = await asyncio.gather(*posts, return_exceptions=True)
            errs = _errors(urls, results)
            try:
                await send
            except Exception as exc:  # noqa: BLE001
                errs.setdefault("trainer", f"broadcast failed: {type(exc).__name__}: {str(exc)[:200]}")
            if errs:
                raise PushError(f"bucket {b.index + 1}/{len(buckets)} ({len(b.names)} tensors) not delivered", errs)
            total += b.nbytes
        seconds = time.perf_counter() - t0
        versions = await _versions(clients)
        return PushResult("distributed", version, total, seconds, num_tensors=len(named), num_buckets=len(buckets),
                          connect_seconds=connect_s, checksum=checksum, versions=versions, group_name=group)
    finally:
        await _teardown(clients, urls, joined, group, trainer_group, pause_mode is not None)


async def _teardown(clients: Sequence[Any], urls: Sequence[str], joined: Sequence[bool], group: str,
                    trainer_group: Any, resume: bool) -> None:
    from dora_megatron.rollout.engine import weight_sync

    gone = await asyncio.gather(*(c.destroy_weights_update_group(group) for c, ok in zip(clients, joined) if ok),
                                return_exceptions=True)
    for err in gone:
        if isinstance(err, BaseException):
            log.warning("destroy_weights_update_group %s: %s", group, err)
    if trainer_group is not None:
        try:
            weight_sync.destroy_weight_update_group(trainer_group)
        except Exception:  # noqa: BLE001 - best effort
            log.warning("could not destroy trainer side of %s", group, exc_info=True)
    if resume:
        await asyncio.gather(*(c.continue_generation() for c in clients), return_exceptions=True)
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def push_distributed(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    engine_urls: Sequence[str],
    bucket_mb: float,
    version: int | str,
    master_addr: str = "127.0.0.1",
    backend: str = "gloo",
    **kwargs: Any,
) -> PushResult:
    """Blocking :func:`push_distributed_async` (for the trainer's command loop, which has no event loop)."""
    return asyncio.run(push_distributed_async(tensors, engine_urls, bucket_mb, version, master_addr, backend, **kwargs))


async def _fan_out(engine_urls: Sequence[str], call, what: str, timeout_s: float) -> tuple[list, float, dict]:
    """Run ``call(client)`` on every engine concurrently; raise :class:`PushError` naming the failed ones.

    Returns the per-engine results, the seconds the calls took and the versions the engines report."""
    from dora_megatron.rollout.client import EngineClient

    urls = [u.rstrip("/") for u in engine_urls]
    clients = [EngineClient(u, timeout_s=timeout_s) for u in urls]
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        seconds = time.perf_counter() - t0
        if _errors(urls, res):
            raise PushError(f"{what} failed", _errors(urls, res))
        versions = await _versions(clients)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    return res, seconds, versions


async def push_disk(snapshot_dir: str, engine_urls: Sequence[str], version: int | str,
                    timeout_s: float = 600.0) -> PushResult:
    """Every engine loads ``snapshot_dir`` (``/update_weights_from_disk``), concurrently."""
    import os

    from dora_megatron.weights.snapshots import WEIGHTS_FILE, read_manifest

    _, seconds, versions = await _fan_out(
        engine_urls, lambda c: c.update_weights_from_disk(snapshot_dir, weight_version=version),
        f"update_weights_from_disk {snapshot_dir}", timeout_s)
    size = os.path.getsize(os.path.join(snapshot_dir, WEIGHTS_FILE)) * len(engine_urls)
    try:
        checksum = read_manifest(snapshot_dir).get("checksum")
    except Exception:  # noqa: BLE001 - a plain HF dir without manifest
        checksum = None
    return PushResult("disk", version, size, seconds, checksum=checksum, versions=versions)


async def push_peer(peer_url: str, engine_urls: Sequence[str], version: int | str,
                    timeout_s: float = 600.0) -> PushResult:
    """Every engine in ``engine_urls`` copies the weights of the instance at ``peer_url``."""
    res, seconds, versions = await _fan_out(
        engine_urls, lambda c: c.update_weights_from_peer(peer_url, weight_version=version),
        f"update_weights_from_peer {peer_url}", timeout_s)
    nbytes = sum(int(r.get("bytes", 0)) for r in res if isinstance(r, dict))
    checksums = {r.get("checksum") for r in res if isinstance(r, dict)}
    return PushResult("peer", version, nbytes, seconds, checksum=checksums.pop() if len(checksums) == 1 else None,
                      versions=versions)
