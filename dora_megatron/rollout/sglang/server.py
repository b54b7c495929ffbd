"""Start SGLang instances as child processes, capture their logs, wait until they serve.

WHY here and not in the launcher: the local launcher and every SLURM node start instances the same
way: the argv from :mod:`.args`, a log file per instance under the run's ``logs/`` (via
:class:`~dora_megatron.launch.processes.ProcessSet`, so stopping the job stops the server's own
children too), then a health poll (``/health_generate`` by default, which runs a one-token
generation in SGLang 0.5.x) that fails fast, with the log tail, when the process exits. Once the
instances serve, :func:`check_versions` warns about any that is not the tested SGLang release.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from dora_megatron.launch.plan import ProcessSpec
from dora_megatron.launch.processes import Child, ProcessSet


log = logging.getLogger(__name__)


class InstanceNotReady(RuntimeError):
    pass


def start_instance(procs: ProcessSet, spec: ProcessSpec) -> Child:
    """Start one planned SGLang process (``spec.role == "engine"``); its output goes to ``<log_dir>/<name>.log``."""
    return procs.start(spec.name, spec.argv, {**spec.env, "PYTHONUNBUFFERED": "1"})


async def wait_ready(url: str, *, path: str = "/health_generate", timeout_s: float = 600.0, interval_s: float = 1.0,
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


def version_warning(url: str, found: str | None) -> str | None:
    """The warning for an instance running another SGLang than the tested one (None: the tested one).

    WHY a warning and not an error: a newer release may well work, but the weight-update protocol
    has changed inside 0.5.x before (sessions since 0.5.22), so the user must know which one was tested."""
    from dora_megatron.rollout.sglang.client import TESTED_SGLANG_VERSION

    if found == TESTED_SGLANG_VERSION:
        return None
    return (f"{url} runs SGLang {found or '(version unknown: no /v1/loads version)'}; dora is tested with SGLang "
            f"{TESTED_SGLANG_VERSION} only (pip install 'dora_megatron[gpu]' pins it): weight updates, aborts and "
            "load polling may behave differently")


async def check_versions(urls: list[str], timeout_s: float = 30.0) -> list[str]:
    """Ask every ready instance its SGLang version (``/v1/loads`` reports it); returns the warnings
    (also logged) for those that are not the tested release."""
    from dora_megatron.rollout.sglang.client import SGLangClient

    async def one(url: str) -> str | None:
        client = SGLangClient(url, timeout_s=timeout_s)
        try:
            found = await client.server_version()
        except Exception as exc:  # noqa: BLE001 - an unreadable version is reported, not fatal
            log.debug("%s: no version: %s", url, exc)
            found = None
        finally:
            await client.close()
        return version_warning(url, found)

    warnings = [w for w in await asyncio.gather(*(one(u) for u in urls)) if w]
    for w in warnings:
        log.warning("%s", w)
    return warnings
