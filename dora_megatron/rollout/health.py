"""Waiting for a rollout server to serve: one poller for SGLang and vLLM instances alike.

WHY one module: both launchers start a child process and must tell "still loading" from "exited"
(``alive()``) and from "never came up" (``timeout_s``), with the log's end in the error. A launcher
that starts thousands of instances at once waits on all of them through one shared session
(:func:`shared_checks`), which bounds the checks on the wire.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from dora_megatron.comm.http_session import HttpSession

#: health checks on the wire at once in a shared session (4,096-instance start-up)
MAX_CHECKS_IN_FLIGHT = 256


class InstanceNotReady(RuntimeError):
    pass


class NotReadyInTime(InstanceNotReady, TimeoutError):
    """Not ready after ``timeout_s`` (a ``TimeoutError`` too: launchers report timeouts as bad start-ups)."""


def shared_checks(max_in_flight: int = MAX_CHECKS_IN_FLIGHT) -> HttpSession:
    """One session for many concurrent :func:`wait_ready` calls, at most ``max_in_flight`` checks on the wire.

    WHY: thousands of sessions polling at once, each with a 5 s total timeout, made a loaded
    controller time out its own checks and retry them for minutes (tools/controller_scale.py at
    4,096 instances). Here connecting and reading are bounded (5 s each), the wait for a
    connection slot is not. The caller closes it (``async with``)."""
    import aiohttp

    return HttpSession(aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=5), limit=max_in_flight)


async def wait_ready(url: str, *, path: str = "/health", timeout_s: float = 600.0, interval_s: float = 1.0,
                     alive: Callable[[], bool] | None = None, tail: Callable[[], str] | None = None,
                     session: HttpSession | None = None, what: str | None = None) -> float:
    """Poll ``url + path`` until HTTP 200; returns the seconds waited.

    Raises :class:`InstanceNotReady` when ``alive()`` turns false (with ``tail()``, the log's end;
    ``alive`` may instead raise an error of its own, e.g. one naming the child that exited), or
    :class:`NotReadyInTime` after ``timeout_s``. ``session``: a shared one (:func:`shared_checks`),
    left open; else one of its own, with ``max(5, 5 * interval_s)`` s per check. ``what``: the
    name the timeout message gives the server (then "<what> not healthy after ... (<url>)")."""
    import aiohttp

    t0 = time.monotonic()
    http = session if session is not None else HttpSession(max(5.0, interval_s * 5))
    target = url.rstrip("/") + path
    try:
        while True:
            if alive is not None and not alive():
                raise InstanceNotReady(f"{url}: process exited before it was ready" + _end(tail))
            try:
                async with http.session().get(target) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise NotReadyInTime((f"{what} not healthy after {timeout_s:.0f} s ({target})" if what
                                      else f"{url}{path} not ready after {timeout_s:.0f} s") + _end(tail))
            await asyncio.sleep(interval_s)
    finally:
        if session is None:
            await http.close()


def _end(tail: Callable[[], str] | None) -> str:
    return f"\n{tail()}" if tail is not None else ""
