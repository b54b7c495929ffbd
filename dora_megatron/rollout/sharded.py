"""Engine clients sharded over worker processes (``rollout.client_workers`` > 0).

WHY: at thousands of instances one asyncio loop cannot run every HTTP round trip itself: stats
polling alone is 2 requests per instance per second, and every ``/generate`` answer is parsed
JSON (docs/results/controller_scale.md: p99 loop lag 856 ms at 4,096 fake instances). Here
each instance's real client lives in one of ``client_workers`` processes
(:mod:`.shard_worker`); the controller holds a :class:`ProxyEngine` per instance, which speaks the
runtime's ``Engine`` protocol unchanged, and one socket per worker that carries every call and
answer of a loop turn as one batched frame (:mod:`.wire`). Load reports come pushed: each worker
polls its own instances and sends one batch per sweep, which the runtime takes from
:meth:`ClientPool.take_reports` instead of polling each instance itself.

Ownership stays where it was: the runtime and its one orchestrator decide everything; a worker
only executes calls. Exactly-once holds across a worker crash because nothing is retried here:
the calls in flight on a dead worker fail with :class:`ConnectionError` (a communication error,
so the runtime fails those instances and the orchestrator re-queues their requests, as for a dead
engine), every later call on its instances fails the same way at once, and the next load report
names each of its instances failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dora_megatron.rollout.wire import FrameWriter, decode_error, read_frame

if TYPE_CHECKING:
    from dora_megatron.comm.protocol import GenerateResponse

log = logging.getLogger(__name__)


class _Worker:
    """The controller's end of one worker process."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 out: FrameWriter) -> None:
        self.index = index
        self.proc = proc
        self.reader = reader
        self.out = out
        self.pending: dict[int, asyncio.Future] = {}
        self.handles: set[int] = set()
        self.dead: str | None = None  # why, once the worker is gone
        self.reports: dict[int, Any] = {}  # handle -> newest load report not yet taken
        self.waits = 0  # calls of this worker that waited for a pooled connection (its last count)
        self.reader_task: asyncio.Task | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def read_loop(self, chunk: int = 64) -> None:
        """Resolves ``chunk`` calls per event-loop turn: a frame of hundreds of answers would
        otherwise run every waiting request's continuation in one turn, and the loop's lag is
        the length of its longest turn."""
        try:
            while True:
                resolved = 0
                for msg in await read_frame(self.reader):
                    kind = msg[0]
                    if kind == "stats":
                        self.reports.update(msg[1])
                        continue
                    if kind == "waits":
                        self.waits = int(msg[1])
                        continue
                    fut = self.pending.pop(msg[1], None)
                    if fut is None or fut.done():
                        continue  # cancelled by the caller meanwhile
                    if kind == "ok":
                        fut.set_result(msg[2])
                    else:
                        fut.set_exception(decode_error(msg[2]))
                    resolved += 1
                    if resolved % chunk == 0:
                        await asyncio.sleep(0)  # let the woken requests (and timers) run first
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as err:
            code = await _exit_code(self.proc)
            self._died(f"engine-client worker {self.index} (pid {self.pid}) exited "
                       f"(code {code}, {type(err).__name__})")
        except Exception as err:  # noqa: BLE001 - a garbled frame: the worker is unusable
            log.exception("engine-client worker %d sent a bad frame", self.index)
            self._died(f"engine-client worker {self.index} (pid {self.pid}) sent a bad frame: {err}")

    def _died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        log.warning("%s; its %d instances fail", why, len(self.handles))
        self.out.closed = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        self.pending.clear()
        for h in self.handles:  # the runtime fails them at its next sweep (no call may be in flight)
            self.reports[h] = ("failed", why)


async def _exit_code(proc: asyncio.subprocess.Process) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), timeout=5)
    except asyncio.TimeoutError:
        return None


class ProxyEngine:
    """One instance's client as the runtime sees it; each call runs in the instance's worker."""

    def __init__(self, pool: "ClientPool", worker: _Worker, handle: int, url: str) -> None:
        self._pool = pool
        self._worker = worker
        self.handle = handle
        self.base_url = url.rstrip("/")
        self._supports: dict[str, bool] = {}

    @property
    def worker_pid(self) -> int:
        return self._worker.pid

    @property
    def pool(self) -> "ClientPool":
        return self._pool

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        w = self._worker
        if w.dead is not None:
            raise ConnectionError(w.dead)
        cid = next(self._pool._ids)
        fut = asyncio.get_running_loop().create_future()
        w.pending[cid] = fut
        w.out.send(("call", cid, self.handle, method, args, kwargs))
        try:
            return await fut
        except asyncio.CancelledError:
            if w.pending.pop(cid, None) is not None and w.dead is None:
                w.out.send(("cancel", cid))  # e.g. the runtime failed the instance: stop the HTTP call
            raise

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       **kw) -> GenerateResponse:  # the worker's client's answer, unpickled
        return await self._call("generate", list(input_ids), sampling_params, rid=rid, return_logprob=return_logprob,
                                version=version, **kw)

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        return await self._call("abort", rid, abort_all)

    async def server_info(self) -> dict[str, Any]:
        return await self._call("server_info")

    async def update_weights_from_disk(self, model_path: str, weight_version=None) -> dict[str, Any]:
        return await self._call("update_weights_from_disk", model_path, weight_version=weight_version)

    async def supports(self, name: str) -> bool:
        """Asked once per name (what an engine offers does not change while its client lives)."""
        if name not in self._supports:
            self._supports[name] = bool(await self._call("supports", name))
        return self._supports[name]

    async def export_request(self, rid: str) -> bytes:
        return await self._call("export_request", rid)

    async def import_request(self, blob: bytes) -> GenerateResponse:
        return await self._call("import_request", blob)

    async def export_kv(self, rid: str) -> bytes:
        return await self._call("export_kv", rid)

    async def import_kv(self, blob: bytes) -> int:
        return await self._call("import_kv", blob)

    async def release_kv(self, rid: str) -> bool:
        return await self._call("release_kv", rid)

    async def weights_checksum(self) -> str:
        return await self._call("weights_checksum")

    async def add_draft_sources(self, rid: str, sources: list[list[int]]) -> bool:
        return await self._call("add_draft_sources", rid, sources)

    async def instance_checksum(self) -> str | None:
        return await self._call("instance_checksum")

    async def continue_generation(self) -> dict[str, Any]:
        return await self._call("continue_generation")

    async def weight_version(self) -> str:
        return await self._call("weight_version")

    async def close(self) -> None:
        self._pool._drop(self)


class ClientPool:
    """``workers`` engine-client processes; :meth:`engine` gives the proxy of one instance.

    Instances go to the workers in turn. ``poll`` (``stats_interval_s``, ``health_timeout_s``,
    ``concurrency``): the workers poll their instances and push the reports
    (:meth:`take_reports`); None: they do not (the runtime polls through the proxies)."""

    def __init__(self, cfg: Any, model_dir: str, poll: dict[str, float] | None, plan: Any = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.poll = poll
        self.plan = plan  # each worker's connection budget (comm.limits.ConnectionPlan), None: aiohttp's default
        self.workers: list[_Worker] = []
        self._ids = itertools.count(1)
        self._handles = itertools.count(1)
        self._by_handle: dict[int, ProxyEngine] = {}
        self._next = 0
        self.closed_cpu_s: float | None = None

    @classmethod
    async def start(cls, cfg: Any, model_dir: str, workers: int, *, poll: dict[str, float] | None = None,
                    log_dir: Path | None = None, plan: Any = None) -> "ClientPool":
        """``plan``: the connection budget of each worker (its share of the instances)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        pool = cls(cfg, model_dir, poll, plan)
        try:
            for i in range(workers):
                pool.workers.append(await pool._spawn(i, log_dir))
        except BaseException:
            await pool.close()
            raise
        return pool

    async def _spawn(self, index: int, log_dir: Path | None) -> _Worker:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the package's parent: the child imports this tree
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        stderr = open(log_dir / f"client_worker{index}.log", "ab") if log_dir is not None else None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "dora_megatron.rollout.shard_worker", "--fd", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env)
        finally:
            theirs.close()
            if stderr is not None:
                stderr.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 24)
        w = _Worker(index, proc, reader, FrameWriter(writer))
        w.out.send(("init", self.cfg, self.model_dir, self.poll, self.plan))
        w.reader_task = asyncio.get_running_loop().create_task(w.read_loop())
        return w

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def cpu_s(self) -> float | None:
        """CPU seconds the live workers used so far (Linux ``/proc``; None elsewhere). After
        :meth:`close`, what they had used just before they stopped; a killed worker is not counted."""
        if self.closed_cpu_s is not None:
            return self.closed_cpu_s
        total, tick = 0.0, os.sysconf("SC_CLK_TCK")
        for w in self.workers:
            try:
                fields = Path(f"/proc/{w.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                if sys.platform.startswith("linux"):
                    continue  # gone (killed)
                return None
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return total

    def engine(self, url: str) -> ProxyEngine:
        """A new proxy for the instance at ``url`` (a restarted instance gets a new one)."""
        w = self.workers[self._next % len(self.workers)]
        self._next += 1
        h = next(self._handles)
        proxy = ProxyEngine(self, w, h, url)
        self._by_handle[h] = proxy
        w.handles.add(h)
        if w.dead is None:
            w.out.send(("add", h, url))
        else:
            w.reports[h] = ("failed", w.dead)
        return proxy

    def _drop(self, proxy: ProxyEngine) -> None:
        w = proxy._worker
        if self._by_handle.pop(proxy.handle, None) is None:
            return
        w.handles.discard(proxy.handle)
        w.reports.pop(proxy.handle, None)
        if w.dead is None and not w.out.closed:
            w.out.send(("drop", proxy.handle))

    def connection_waits(self) -> int:
        """Calls the workers made wait for a pooled connection (back-pressure), as they last reported."""
        return sum(w.waits for w in self.workers)

    def covers(self, engine: Any) -> bool:
        """True for this pool's proxies: their load comes pushed, the runtime does not poll them."""
        return isinstance(engine, ProxyEngine) and engine._pool is self

    def take_reports(self) -> dict[ProxyEngine, Any]:
        """The load reports that arrived since the last call, newest per instance: the
        ``server_info`` dict, or ``("failed", why)`` for an instance to fail."""
        out: dict[ProxyEngine, Any] = {}
        for w in self.workers:
            if not w.reports:
                continue
            reports, w.reports = w.reports, {}
            for h, rep in reports.items():
                proxy = self._by_handle.get(h)
                if proxy is not None:
                    out[proxy] = rep
        return out

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker: ``stop``, then SIGKILL by pid if it does not exit within ``timeout_s``."""
        if self.closed_cpu_s is None:
            self.closed_cpu_s = self.cpu_s()
        for w in self.workers:
            if w.dead is None and not w.out.closed:
                w.out.send(("stop",))
                w.out.close()
            w.dead = w.dead or "the engine-client pool is closed"  # its exit is no failure
            for fut in w.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(w.dead))
            w.pending.clear()
        for w in self.workers:
            try:
                await asyncio.wait_for(w.proc.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                log.warning("engine-client worker %d (pid %d) did not stop; killing it", w.index, w.pid)
                w.proc.kill()
                await w.proc.wait()
            if w.reader_task is not None:
                w.reader_task.cancel()
                await asyncio.gather(w.reader_task, return_exceptions=True)
