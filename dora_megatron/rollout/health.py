"""Waiting for a rollout server to serve: one poller for SGLang and vLLM instances alike.

WHY one module: both launchers start a child process and must tell "still loading" from "exited"
(``alive()``) and from "never came up" (``timeout_s``), with the log's end in the error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class InstanceNotReady(RuntimeError):
    pass


async def wait_ready(url: str, *, path: str = "/health", timeout_s: float = 600.0, interval_s: float = 1.0,
                     alive: Callable[[], bool] | None = None, tail: Callable[[], str] | None = None) -> float:
    """Poll ``url + path`` until HTTP 200; returns the seconds waited.

    Raises :class:`InstanceNotReady` when ``alive()`` turns false (with ``tail()``, the log's end) or
    after ``timeout_s``."""
    import aiohttp

    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(5.0, interval_s * 5))) as session:
        while True:
            if alive is not None and not alive():
                raise InstanceNotReady(f"{url}: process exited before it was ready\n{tail() if tail else ''}")
            try:
                async with session.get(url.rstrip("/") + path) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise InstanceNotReady(f"{url}{path} not ready after {timeout_s:.0f} s\n{tail() if tail else ''}")
            await asyncio.sleep(interval_s)
