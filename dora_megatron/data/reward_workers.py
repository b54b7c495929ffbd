"""A user's reward function in worker processes, with a time limit per call: :class:`ProcessScorer`.

Why processes: a reward function is someone else's code. It may take seconds (a symbolic checker,
a sandboxed program), hold the GIL, hang forever, leak memory or crash the interpreter. In a worker
process none of that reaches the controller: a call longer than ``data.reward_timeout_s`` is
answered with reward 0 and an error, and its worker is killed and replaced; an exception is the
sample's reward 0 with the traceback kept for the log; a worker that dies is replaced. Nothing a
reward does fails the run.

Each worker imports the function once (``spawn``: a fresh interpreter, no copy of the controller's
threads or sockets) and then answers one call at a time over a pipe. A coroutine function is
awaited on the worker's own event loop. The pool hands a call to an idle worker; ``score`` waits on
a thread of its own, so the controller's event loop only awaits.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from dora_megatron.data.reward_api import RewardInput, RewardResult

log = logging.getLogger(__name__)

#: How long a new worker may take to import the reward function.
START_TIMEOUT_S = 120.0


def _serve(conn, spec: str) -> None:
    """A worker's loop: load ``spec``, say so, then answer ``(data_source, solution_str, ground_truth,
    extra_info)`` tuples with ``("ok", score, extras)`` or ``("error", message, traceback)`` until
    ``None`` or the controller's end of the pipe closes."""
    from dora_megatron.data.rewards import load_reward_function, normalise_result

    try:
        fn = load_reward_function(spec)
    except Exception as err:  # noqa: BLE001 - reported to the controller, which refuses to start
        conn.send(("load_error", str(err), traceback.format_exc()))
        return
    conn.send(("ready", None, None))
    loop = asyncio.new_event_loop()
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):  # the controller is gone
            break
        if item is None:
            break
        data_source, solution_str, ground_truth, extra_info = item
        try:
            value = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                       extra_info=extra_info)
            if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
                value = loop.run_until_complete(value)
            score, extras = normalise_result(value)
            reply = ("ok", score, extras)
        except BaseException as err:  # noqa: BLE001 - SystemExit in user code too: the sample's error
            reply = ("error", f"{type(err).__name__}: {err}", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    loop.close()


class _Worker:
    """One worker process and the controller's end of its pipe."""

    def __init__(self, ctx, spec: str) -> None:
        self.ctx, self.spec = ctx, spec
        self.proc = None
        self.conn = None
        self.start()

    def start(self) -> None:
        from dora_megatron.data.rewards import RewardLoadError

        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child, self.spec), daemon=True, name="dora-reward")
        self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(START_TIMEOUT_S):
            self.kill()
            raise RewardLoadError(f"data.reward_fn: {self.spec}: a worker did not load it within {START_TIMEOUT_S:g} s")
        try:
            kind, message, _ = parent.recv()
        except EOFError:
            code = self.proc.exitcode
            self.kill()
            raise RewardLoadError(f"data.reward_fn: {self.spec}: the worker exited while loading it (code {code})") from None
        if kind != "ready":
            self.kill()
            raise RewardLoadError(message)

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()

    def replace(self, why: str) -> None:
        log.warning("reward worker pid %s replaced: %s", self.proc.pid if self.proc else None, why)
        self.kill()
        self.start()

    def call(self, item: RewardInput, timeout_s: float) -> RewardResult:
        try:
            self.conn.send((item.data_source, item.solution_str, item.ground_truth, dict(item.extra_info)))
        except (BrokenPipeError, OSError):  # died while idle: a fresh one takes the call
            self.replace(f"its pipe was closed (exit code {self.proc.exitcode})")
            self.conn.send((item.data_source, item.solution_str, item.ground_truth, dict(item.extra_info)))
        t0 = time.monotonic()
        if not self.conn.poll(timeout_s):
            self.replace(f"a call ran past data.reward_timeout_s={timeout_s:g} s")
            return RewardResult(0.0, error=f"timed out after {timeout_s:g} s (data.reward_timeout_s)")
        try:
            kind, a, b = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1)
            code = self.proc.exitcode
            self.replace(f"it died during a call (exit code {code})")
            return RewardResult(0.0, error=f"the reward worker died during the call (exit code {code}, "
                                           f"after {time.monotonic() - t0:.1f} s)")
        if kind == "ok":
            return RewardResult(float(a), dict(b))
        return RewardResult(0.0, error=str(a), traceback=str(b))


class ProcessScorer:
    """:class:`~dora_megatron.data.reward_api.RewardScorer` running ``spec`` (``module:function`` or
    ``file.py:function``, verl's signature) in ``workers`` processes, each call limited to
    ``timeout_s``. The workers start (and load the function) here: a function that cannot be loaded
    raises :class:`~dora_megatron.data.rewards.RewardLoadError` before any sample is scored."""

    def __init__(self, spec: str, workers: int = 2, timeout_s: float = 30.0) -> None:
        if workers < 1:
            raise ValueError(f"data.reward_workers must be >= 1, got {workers}")
        self.spec, self.timeout_s = spec, float(timeout_s)
        ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(_Worker(ctx, spec))
        except BaseException:
            self.close()
            raise
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._workers:
            self._idle.put(w)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dora-reward")
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (they change as hung or dead workers are replaced)."""
        return [w.proc.pid for w in self._workers if w.proc is not None]

    def score_sync(self, item: RewardInput) -> RewardResult:
        """Score on the calling thread: wait for an idle worker, hand it the call, wait for the answer
        or the time limit."""
        if self._closed:
            raise RuntimeError("ProcessScorer is closed")
        worker = self._idle.get()
        try:
            return worker.call(item, self.timeout_s)
        finally:
            self._idle.put(worker)

    async def score(self, item: RewardInput) -> RewardResult:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.score_sync, item)

    def close(self) -> None:
        """Stop every worker (asked first, killed after 5 s)."""
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError, AttributeError):
                pass
        for w in self._workers:
            if w.proc is not None:
                w.proc.join(5)
            w.kill()
        threads = getattr(self, "_threads", None)
        if threads is not None:
            threads.shutdown(wait=False)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
