"""Async client of the trainer service (:mod:`dora_megatron.trainer.service`)."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

from dora_megatron.comm.batch_files import write_batch
from dora_megatron.comm.http_session import HttpSession
from dora_megatron.comm.routed_spool import SPOOL_DIR, RoutedSpool, SpooledRouted
from dora_megatron.comm.train_sample import TrainSample, encode_train


@dataclass(frozen=True)
class PushOptions:
    """The fields of ``POST /push_weights`` that stay the same for every push of a run
    (``controller.weight_transport: distributed``); the launcher fills them from the config
    (:func:`~dora_megatron.controller.main.push_options`). ``bucket_mb`` is ``controller.bucket_mb``
    (no default of its own); the rest default to what the trainer chooses alone."""

    bucket_mb: float
    master_addr: str | None = None  # where engines reach the trainer's rendezvous (None: the trainer's loopback)
    master_port: int | None = None  # its store port (None: a free port per push)
    backend: str | None = None  # gloo | nccl (None: the trainer's choice by its device)
    engine_ranks: int = 1  # ranks one engine takes in a weight-update group (SGLang: its TP size)
    pause_mode: str | None = None  # /pause_generation around a broadcast (None: the instances were drained)

    def request(self, engines: list[str]) -> dict[str, Any]:
        """Keyword arguments of :meth:`TrainerClient.push_weights` for a push to ``engines``."""
        return {"bucket_mb": self.bucket_mb, "master_addr": self.master_addr, "master_port": self.master_port,
                "backend": self.backend, "pause_mode": self.pause_mode,
                "gpus": {u: self.engine_ranks for u in engines} if self.engine_ranks != 1 else None}


class TrainerError(RuntimeError):
    pass


class TrainerUnreachable(TrainerError):
    """No answer at all (connection refused or dropped): the trainer process is likely gone."""


def _batch_request(step: int, directory: Path, samples: list[TrainSample], spool: RoutedSpool | None) -> bytes:
    """The ``/train`` body of a batch written as files to ``directory``, encoded where it was
    written (a worker thread), once the spool's writes it names are in their files. WHY encoded
    here: its ``batch.samples`` entry is a few fields per sample, 8,192 objects for the paper's
    step; ``json=`` would have encoded them on the event loop."""
    if spool is not None:
        spool.flush()
    return json.dumps({"step": step, "batch": write_batch(directory, samples)}).encode()


class TrainerClient:
    def __init__(self, base_url: str, timeout_s: float = 3600.0, batch_dir: Path | None = None) -> None:
        """``batch_dir``: where a released batch is written as columnar files for the trainer's ranks
        (:mod:`dora_megatron.comm.batch_files`; the run directory's ``batches``, on the filesystem
        the trainer shares with the controller); None: the samples go in the ``/train`` body."""
        self.base_url = base_url.rstrip("/")
        self._http = HttpSession(timeout_s)
        self.batch_dir = Path(batch_dir) if batch_dir is not None else None
        #: finished samples' routed experts, written as they finish (the sample store queues them)
        self.routed_spool = RoutedSpool(self.batch_dir / SPOOL_DIR) if self.batch_dir is not None else None

    async def close(self) -> None:
        await self._http.close()
        if self.routed_spool is not None:
            await asyncio.to_thread(self.routed_spool.close)

    async def _post(self, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
        """``body``: a JSON object, or one already encoded (``/train``'s samples, off the loop)."""
        kw: dict[str, Any] = ({"data": body, "headers": {"Content-Type": "application/json"}}
                              if isinstance(body, bytes) else {"json": body})
        try:
            async with self._http.session().post(self.base_url + path, **kw) as resp:
                data = await resp.json(content_type=None)
        except aiohttp.ClientError as err:
            raise TrainerUnreachable(f"trainer {path}: no answer from {self.base_url}: {err}") from err
        if resp.status >= 400:
            raise TrainerError(f"trainer {path}: HTTP {resp.status}: {data.get('error') if isinstance(data, dict) else data}")
        answer: dict[str, Any] = data  # every trainer route answers a JSON object
        return answer

    async def health(self) -> dict[str, Any] | None:
        try:
            async with self._http.session().get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def train(self, step: int, samples: list[TrainSample]) -> dict[str, Any]:
        """One training step on ``samples``. With a ``batch_dir`` the samples are written there in
        a worker thread (bulk array copies: the event loop keeps running) and the body names the
        directory; the directory goes once the trainer answered (its ranks have read it)."""
        if self.batch_dir is None:
            return await self._post("/train", await asyncio.to_thread(encode_train, step, samples))
        directory = self.batch_dir / f"step_{step:06d}"
        body = await asyncio.to_thread(_batch_request, step, directory, samples, self.routed_spool)
        try:
            answer = await self._post("/train", body)
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)
        spooled = [s.routed_experts for s in samples if isinstance(s.routed_experts, SpooledRouted)]
        if spooled and self.routed_spool is not None:  # trained: their segments go once no checkpoint needs them
            self.routed_spool.retire(spooled)  # counts, and deletions queued to the spool's thread
        return answer

    async def push_weights(self, engines: list[str], bucket_mb: float, master_addr: str | None = None,
                           timeout_s: float | None = None, gpus: dict[str, int] | None = None,
                           pause_mode: str | None = None, master_port: int | None = None,
                           backend: str | None = None) -> dict[str, Any]:
        """Broadcast the trainer's current weights to ``engines`` (``POST /push_weights``); ``gpus``:
        engine URL -> ranks it takes in the group (its TP size, 1 when absent); ``pause_mode``: pause
        the engines around the push (None: the caller drained them).

        Returns ``bytes, seconds, num_buckets, checksum`` (of what was sent), ``versions``
        (engine URL -> reported weight_version) and ``version``; raises :class:`TrainerError` if an
        engine did not get them."""
        body: dict[str, Any] = {"engines": list(engines), "bucket_mb": bucket_mb}
        if master_addr is not None:
            body["master_addr"] = master_addr
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if gpus:
            body["gpus"] = dict(gpus)
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        if master_port is not None:
            body["master_port"] = master_port
        if backend is not None:
            body["backend"] = backend
        return await self._post("/push_weights", body)

    async def save_checkpoint(self, path: str) -> dict[str, Any]:
        return await self._post("/save_checkpoint", {"path": path})

    async def shutdown(self) -> bool:
        """Ask every rank to leave its loop; True when the trainer acknowledged it."""
        try:
            await self._post("/shutdown", {})
        except (aiohttp.ClientError, asyncio.TimeoutError, TrainerError):
            return False
        return True

    async def leave(self, timeout_s: float, exited: Callable[[float], Awaitable[None]]) -> None:
        """At the end of a run: :meth:`shutdown` (bounded: a lost trainer may be hung); a trainer that
        acknowledged it is left to end by itself (``await exited(timeout_s)``: SIGTERM would leave
        torchrun a SignalException traceback); then the client closes."""
        try:
            acked = await asyncio.wait_for(self.shutdown(), timeout=timeout_s)
        except asyncio.TimeoutError:
            acked = False
        if acked:
            await exited(timeout_s)
        await self.close()
