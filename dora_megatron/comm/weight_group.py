"""The torch.distributed group over which a trainer broadcasts weights to rollout engines.

Why a custom group instead of ``dist.init_process_group``: the trainer process already owns
its default (torchrun) group, so the weight-update group must be a second, independent group.
Like slime does for SGLang, both sides create it from a TCPStore rendezvous at
``tcp://master_address:master_port`` wrapped in ``PrefixStore(group_name, store)`` and built
with torch's ``_new_process_group_helper`` (no default group needed or touched). The trainer
calls :func:`init_weight_update_group` with ``rank=0`` (it hosts the store); each engine calls it
with ``rank=rank_offset`` (the ``/init_weights_update_group`` handler does). Tensors are then sent
with ``dist.broadcast(t, src=0, group=group)`` in the order of the ``names`` list. The same
function is what a trainer should use towards SGLang engines (same store layout as slime's).
Backend: gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store, TCPStore


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    connect_timeout_s: float | None = None,
) -> ProcessGroup:
    """Create (collectively, all ranks) and return a process group independent of the default one.

    ``connect_timeout_s`` bounds reaching the store at ``master_address:master_port`` (the
    TCPStore client retries until then); ``timeout_s`` bounds every later collective. An engine
    passes a short connect timeout so that a wrong address or port fails in seconds, not minutes.
    """
    store = connect_store(master_address, master_port, rank, world_size, min(timeout_s, connect_timeout_s or timeout_s))
    return group_from_store(store, rank, world_size, group_name, backend, timeout_s)


def connect_store(master_address: str, master_port: int, rank: int, world_size: int,
                  connect_timeout_s: float) -> TCPStore:
    """The rendezvous TCPStore: rank 0 hosts it, the other ranks connect as clients.

    Built directly rather than through ``c10d.rendezvous("tcp://...")``: inside a process started
    by torchrun (the trainer) that helper sees ``TORCHELASTIC_USE_AGENT_STORE`` and connects as a
    client to what it takes for the elastic agent's store, so nobody would host this one.

    Caveat (torch 2.13): a peer that accepts the TCP connection but never answers the store's
    handshake blocks this call regardless of the timeout; callers that must not hang run it in a
    thread they can abandon (the engine's ``/init_weights_update_group`` does).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build")
    return dist.TCPStore(master_address.strip("[]"), master_port, world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=connect_timeout_s))


def group_from_store(store: Store, rank: int, world_size: int, group_name: str, backend: str,
                     timeout_s: float) -> ProcessGroup:
    """Collectively build the group over a connected store (waits up to ``timeout_s`` for all ranks)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    prefix_store = c10d.PrefixStore(group_name, store)
    pg: ProcessGroup  # torch leaves the helper's return unannotated; it is (group, backend)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, prefix_store, group_name=c10d.GroupName(group_name), timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def group_name_in_use(group_name: str) -> bool:
    """Whether this process already made a process group named ``group_name``: torch refuses a second
    one, and only after this rank's store is up, so the other ranks would wait on it for their whole
    group timeout. A caller checks first and contacts no one."""
    from torch.distributed import distributed_c10d as c10d

    return group_name in c10d._world.pg_names.values()


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """Run ``fn`` on a new daemon thread; the future can be abandoned if ``fn`` never returns.

    Why not ``asyncio.to_thread``: a group rendezvous cannot be cancelled, and the loop's default
    executor is joined when ``asyncio.run`` ends, so an abandoned rendezvous there holds the caller
    for its whole timeout. A daemon thread is left to time out on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():  # abandoned
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def work() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            value, exc = None, e
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for it
                pass

    threading.Thread(target=work, name="dora-group-connect", daemon=True).start()
    return fut


def destroy_weight_update_group(group: ProcessGroup) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def receive_tensors(
    group: ProcessGroup, shapes: list[list[int]], dtypes: list[torch.dtype], device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Receive one broadcast from rank 0 per entry, in order."""
    import torch.distributed as dist

    out = []
    for shape, dtype in zip(shapes, dtypes):
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.broadcast(t, src=0, group=group)
        out.append(t)
    return out


def send_tensors(group: ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0 side of :func:`receive_tensors`."""
    import torch.distributed as dist

    for t in tensors:
        dist.broadcast(t.contiguous(), src=0, group=group)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError otherwise."""
    short = name[len("torch.") :] if name.startswith("torch.") else name
    dt = getattr(torch, short, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt
