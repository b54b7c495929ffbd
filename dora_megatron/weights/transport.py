"""Trainer-side weight transports to rollout engines: distributed broadcast and disk.

WHY: after a training step the new version must reach some rollout instances quickly, the others
later (DORA keeps several versions live). Two ways, all ending with the engine reporting the new
``weight_version`` and a weights checksum equal to the trainer's export checksum:

``distributed`` (:func:`push_distributed`): SGLang's ``/init_weights_update_group`` +
``/update_weights_from_distributed`` (reference B.2) through
:class:`dora_megatron.weights.distributed.DistributedWeightPusher`, one group per push (the trainer
is rank 0, engine ``i`` takes as many consecutive ranks as it has GPUs), destroyed afterwards on
both sides. Gloo on CPU, NCCL on CUDA. Its failure semantics are in that module.

``disk`` (:func:`push_disk`): every engine loads a snapshot directory written by
:mod:`dora_megatron.weights.snapshots` (``/update_weights_from_disk``); a late switch to an older
live version loads its snapshot the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence

from dora_megatron.ports import job_port_range, pick_ports
from dora_megatron.weights.distributed import DistributedWeightPusher
from dora_megatron.weights.results import PushError, PushResult, failures

if TYPE_CHECKING:
    from dora_megatron.comm.engine_client import EngineClient
    from dora_megatron.comm.json_value import JSONObject

__all__ = ["PushError", "PushResult", "push_disk", "push_distributed", "push_distributed_async"]

log = logging.getLogger(__name__)


async def _versions(clients: Sequence[EngineClient]) -> dict[str, str]:
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
    gpus: Mapping[str, int] | None = None,
    master_port: int | None = None,
    port_range: tuple[int, int] | None = None,
) -> PushResult:
    """Broadcast HF-named ``tensors`` to every engine in buckets of at most ``bucket_mb`` MiB.

    ``timeout_s`` bounds the group rendezvous and every broadcast (a rejected or dead engine makes
    the push fail after at most that long). ``pause_mode`` (``"abort"``, ``"retract"``,
    ``"in_place"``): pause the engines before the first bucket and continue them after the last;
    None: the caller drained them. ``gpus``: engine URL -> its TP size (ranks in the group; 1 when
    absent). ``master_port``: the rendezvous store's port on this host (None: a free one of ``port_range``,
    ``launch.port_range``; None: the default job range, :func:`~dora_megatron.ports.job_port_range`).
    Raises :class:`PushError` when any engine failed (every engine's update session is closed and its
    generation continued on every exit path all the same); returns a
    :class:`PushResult` whose ``seconds`` include forming the group."""
    from dora_megatron.comm.sglang_client import SGLangClient
    from dora_megatron.comm.checksum import weights_checksum

    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    urls = [u.rstrip("/") for u in engine_urls]
    if not urls:
        raise ValueError("no engines to push to")
    ranks = {u.rstrip("/"): int(n) for u, n in (gpus or {}).items()}
    unknown = sorted(set(ranks) - set(urls))
    if unknown:
        raise ValueError(f"gpus names engines that are not pushed to: {unknown}")
    checksum = weights_checksum({n: t.detach().cpu() for n, t in items}) if compute_checksum else None
    t0 = time.perf_counter()
    clients = {u: SGLangClient(u, timeout_s=timeout_s + 60) for u in urls}
    pusher = DistributedWeightPusher(
        clients, {u: ranks.get(u, 1) for u in urls}, master_address=master_addr, master_port=master_port or pick_ports(1, master_addr, port_range or job_port_range())[0],
        group_name=group_name or f"dora-w{version}-{uuid.uuid4().hex[:8]}", backend=backend, pause_mode=pause_mode,
        bucket_mb=bucket_mb, timeout_s=timeout_s)
    try:
        await pusher.connect()
        result = await pusher.push(version, items)
    finally:
        await pusher.disconnect()
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)
    return dataclasses.replace(result, seconds=time.perf_counter() - t0, checksum=checksum)


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


async def _fan_out(engine_urls: Sequence[str], call: Callable[[EngineClient], Awaitable[JSONObject]], what: str,
                   timeout_s: float) -> tuple[list[JSONObject | BaseException], float, dict[str, str]]:
    """Run ``call(client)`` on every engine concurrently; raise :class:`PushError` naming the failed ones.

    Returns the per-engine results, the seconds the calls took and the versions the engines report."""
    from dora_megatron.comm.engine_client import EngineClient

    urls = [u.rstrip("/") for u in engine_urls]
    clients = [EngineClient(u, timeout_s=timeout_s) for u in urls]
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        seconds = time.perf_counter() - t0
        if errors := failures(urls, res):
            raise PushError(f"{what} failed", errors)
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
        checksum: str | None = read_manifest(snapshot_dir).checksum
    except Exception:  # noqa: BLE001 - a plain HF dir without manifest
        checksum = None
    return PushResult("disk", version, size, seconds, checksum=checksum, versions=versions)

