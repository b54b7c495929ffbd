"""An engine-client worker process: owns the HTTP clients of a subset of the rollout instances.

``python -m dora_megatron.rollout.shard_worker --fd N`` is started by
:class:`~dora_megatron.rollout.sharded.ClientPool` with one end of a socketpair as fd ``N``. It
builds each instance's real client (:func:`~dora_megatron.rollout.factory.engine_for`, so SGLang's
adapter and its C1 check run here exactly as in process), runs every call the controller sends
(``/generate``, abort, pause/continue, weight loads, checks) as its own task, and polls its
instances' load every ``stats_interval_s``, sending one batched report per sweep. Results go back
batched per loop turn (:mod:`.wire`).

WHY here and not in the controller: at thousands of instances the HTTP round trips (and the JSON
of every answer) are what the controller's one event loop cannot keep up with
(``tools/controller_scale.py``, docs/results/controller_scale.md); a worker spends that CPU
in its own process. The worker decides nothing: it holds no orchestrator state, so its crash
loses only in-flight calls, which the controller sees as failures of those instances.

A timed-out poll is asked again before the instance is reported failed (as the in-process
poller does); any other poll error reports it at once. The worker exits when the controller's
end of the socket closes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Any

from dora_megatron.rollout.wire import FrameWriter, encode_error, read_frame, slim_response

log = logging.getLogger("dora_megatron.shard_worker")

#: what the controller may call on an engine (the runtime's Engine protocol and the SGLang extras)
METHODS = frozenset({"generate", "abort", "server_info", "update_weights_from_disk", "supports", "export_request",
                     "import_request", "weights_checksum", "continue_generation", "instance_checksum",
                     "weight_version", "pause", "flush_cache", "add_draft_sources"})


class Worker:
    def __init__(self, out: FrameWriter) -> None:
        self.out = out
        self.engines: dict[int, Any] = {}
        self.calls: dict[int, asyncio.Task] = {}
        self.polled: set[int] = set()  # handles still polled (a failed one stops)
        self.cfg = None
        self.model_dir = ""
        self.poll: dict[str, float] | None = None
        self.plan = None  # the connection budget of this process (comm.limits.ConnectionPlan), from ``init``
        from dora_megatron.comm.answer_reader import AnswerReader
        from dora_megatron.comm.limits import ConnectionWaits

        self.waits = ConnectionWaits()  # sent to the controller after each poll sweep (``waits``)
        #: how this worker reads big answers (the bytes read at once, the one decoder thread); closed by :meth:`close`
        self.reader = AnswerReader()
        self._waits_sent = 0
        self._poller: asyncio.Task | None = None

    def handle(self, msg: tuple) -> bool:
        """Apply one message; False on ``stop``."""
        kind = msg[0]
        if kind == "call":
            _, cid, h, method, args, kwargs = msg
            task = asyncio.get_running_loop().create_task(self._call(cid, h, method, args, kwargs))
            self.calls[cid] = task
            task.add_done_callback(lambda t, cid=cid: self.calls.pop(cid, None))
        elif kind == "cancel":
            task = self.calls.get(msg[1])
            if task is not None:
                task.cancel()
        elif kind == "add":
            from dora_megatron.rollout.factory import engine_for

            _, h, url = msg
            self.engines[h] = engine_for(self.cfg, url, self.model_dir, plan=self.plan, waits=self.waits,
                                         reader=self.reader)
            if self.poll is not None:
                self.polled.add(h)
                if self._poller is None:
                    self._poller = asyncio.get_running_loop().create_task(self._poll_loop())
        elif kind == "drop":
            self.polled.discard(msg[1])
            engine = self.engines.pop(msg[1], None)
            if engine is not None:
                asyncio.get_running_loop().create_task(engine.close())
        elif kind == "init":
            self.cfg, self.model_dir, self.poll = msg[1:4]
            self.plan = msg[4] if len(msg) > 4 else None
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown message {kind!r}")
        return True

    async def _call(self, cid: int, h: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            engine = self.engines.get(h)
            if engine is None:
                raise ConnectionError(f"instance handle {h} is not open in this worker")
            if method not in METHODS:
                raise ValueError(f"method {method!r} is not an engine call")
            fn = getattr(engine, method, None)
            if fn is None:  # e.g. instance_checksum on the embedded engine's client: the runtime reads None
                result = None
            else:
                result = await fn(*args, **kwargs)
            if method in ("generate", "import_request"):
                result = slim_response(result)
            self.out.send(("ok", cid, result))
        except asyncio.CancelledError:
            return  # the controller gave up on it (its future is cancelled already)
        except Exception as err:  # noqa: BLE001 - every failure goes back to the caller
            self.out.send(("err", cid, encode_error(err)))

    async def _poll_one(self, h: int, slots: asyncio.Semaphore) -> tuple[int, Any] | None:
        timeout = self.poll["health_timeout_s"]
        async with slots:
            for attempt in (1, 2):
                engine = self.engines.get(h)
                if engine is None or h not in self.polled:
                    return None
                try:
                    return h, await asyncio.wait_for(engine.server_info(), timeout=timeout)
                except asyncio.TimeoutError:
                    if attempt == 2:
                        self.polled.discard(h)
                        return h, ("failed", f"server_info did not answer within {timeout:g} s "
                                             "(controller.health_timeout_s), twice in a row")
                except Exception as err:  # noqa: BLE001 - an unreachable engine is a failed one
                    from dora_megatron.comm.limits import local_resource_error

                    if local_resource_error(err):  # this process's shortage: no report this sweep
                        return None
                    self.polled.discard(h)
                    return h, ("failed", f"server_info failed: {err}")
        return None

    async def _poll_loop(self) -> None:
        """One concurrent sweep over the polled instances every ``stats_interval_s``, one message each."""
        slots = asyncio.Semaphore(max(1, int(self.poll["concurrency"])))
        while True:
            got = await asyncio.gather(*(self._poll_one(h, slots) for h in list(self.polled)))
            reports = dict(x for x in got if x is not None)
            if reports:
                self.out.send(("stats", reports))
            if self.waits.count != self._waits_sent:
                self._waits_sent = self.waits.count
                self.out.send(("waits", self.waits.count))
            await asyncio.sleep(self.poll["interval_s"])

    async def close(self) -> None:
        for task in [*self.calls.values(), *([self._poller] if self._poller else [])]:
            task.cancel()
        await asyncio.gather(*self.calls.values(), *([self._poller] if self._poller else []), return_exceptions=True)
        for engine in self.engines.values():
            try:
                await engine.close()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self.reader.close()


async def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 24)
    out = FrameWriter(writer)
    worker = Worker(out)
    try:
        while True:
            try:
                batch = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the controller is gone
            if not all(worker.handle(m) for m in batch):
                return
    finally:
        await worker.close()
        out.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="engine-client worker of the dora controller (started by it)")
    p.add_argument("--fd", type=int, required=True, help="the socket to the controller")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dora_megatron.comm.limits import raise_open_files_limit

    raise_open_files_limit()  # a socket per connection to an instance
    asyncio.run(serve(args.fd))


if __name__ == "__main__":
    sys.exit(main())
