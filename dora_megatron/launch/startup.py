"""The start of a job: begin with the rollout instances that came up, not with all of them.

WHY: on a large allocation some instance fails to start almost every time (a bad node, an OOM while
loading, a SIGKILL); ending the job for it wastes the whole allocation. So the launcher waits for
the instances (:func:`wait_for_instances`), restarts one that died under the same budget as a
restart mid-run (``launch.max_engine_restarts``, every restart counts), and starts once
:func:`startup_decision` says enough are ready (``launch.min_ready_instances``). The instances not
ready then are handed to the supervisor (:class:`~dora_megatron.launch.supervise.EngineSupervisor`):
it keeps restarting the failed ones and adds each to the pool once it serves, the path an instance
restarted mid-run takes. The job refuses to start only when fewer than the minimum are ready within
``rollout.startup_timeout_s`` (or can no longer be: no restart left), naming each instance not
ready and why (its own last error line).

The decision is a pure function of what is known, so the local launcher and the controller's node
of a SLURM job (the same :func:`~dora_megatron.controller.main.run_controller`) decide alike; under
SLURM the controller sees the instances of other nodes only through ``/health`` (their own node
restarts them on the same port), so such an instance counts as loading until it answers or the
timeout passes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from dora_megatron.processes import Child, ProcessSet, last_error_line

log = logging.getLogger(__name__)


class StartupRefused(RuntimeError):
    """Fewer rollout instances than ``launch.min_ready_instances`` are ready (or can still be)."""


def required_ready(min_ready: int | float | None, total: int) -> int | None:
    """How many instances must be ready to start: ``None`` (the default) means *every instance that
    did not fail* (no fixed count: the start waits until each one is ready or has failed, and needs
    at least one); an integer is a count (1 .. ``total``); a float in (0, 1] is a fraction of
    ``total``, rounded up (``1.0``: all of them)."""
    if min_ready is None:
        return None
    if isinstance(min_ready, bool):
        raise ValueError(f"launch.min_ready_instances: expected a count or a fraction, got {min_ready!r}")
    if isinstance(min_ready, int):
        if not 1 <= min_ready <= total:
            raise ValueError(f"launch.min_ready_instances={min_ready}: a count must be between 1 and the "
                             f"{total} rollout instance(s) of this job")
        return min_ready
    if not 0.0 < min_ready <= 1.0:
        raise ValueError(f"launch.min_ready_instances={min_ready}: a fraction must be in (0, 1]")
    return max(1, math.ceil(min_ready * total - 1e-9))


@dataclass(frozen=True)
class StartupView:
    """What the launcher knows of the instances at one moment of the start.

    ``loading``: on their first start, neither ready nor failed. ``failed``: failed at least once and
    not ready now (name -> why). ``retrying``: the failed ones that may still come up (a restart is
    under way or left). An instance of another SLURM node is loading until it answers: only its own
    node sees it exit (and restarts it on the same port)."""

    total: int
    ready: frozenset[str]
    loading: frozenset[str]
    failed: Mapping[str, str]
    retrying: frozenset[str]
    elapsed_s: float
    timeout_s: float


def startup_decision(view: StartupView, min_ready: int | float | None) -> bool:
    """True: start now (the instances not ready join as they become ready); False: wait. Raises
    :class:`StartupRefused` naming every instance not ready and why when the minimum is not met within
    ``timeout_s`` or can no longer be met."""
    need = required_ready(min_ready, view.total)
    ready = len(view.ready)
    timed_out = view.elapsed_s >= view.timeout_s
    if need is not None and ready >= need:
        return True
    if need is None and ready >= 1 and (not view.loading or timed_out):
        return True
    possible = ready + len(view.loading) + len(view.retrying)
    if timed_out or possible < max(need or 1, 1):
        why = (f"within rollout.startup_timeout_s={view.timeout_s:g} s" if timed_out
               else "and no restart is left (launch.max_engine_restarts)")
        wanted = (f"launch.min_ready_instances={min_ready!r} needs {need}" if need is not None
                  else "at least one is needed")
        raise StartupRefused(f"only {ready} of {view.total} rollout instance(s) became ready {why} ({wanted}); "
                             f"not ready: {_not_ready(view)}")
    return False


def _not_ready(view: StartupView) -> str:
    parts = [f"{n}: {view.failed[n]}" for n in sorted(view.failed)]
    parts += [f"{n}: not healthy after {view.elapsed_s:.0f} s (still loading)" for n in sorted(view.loading)]
    return "; ".join(parts) or "none"


def exit_reason(child: Child) -> str:
    """Why a child exited, in one line: its status and its own last error line, and where its log is."""
    try:
        text = child.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    error = last_error_line(text)
    return f"exited with status {child.popen.returncode}" + (f": {error}" if error else "") + f" (log {child.log_path})"


@dataclass
class StartupResult:
    """The instances at the start: ``urls`` (every instance, restarted ones at their new URL),
    ``ready`` names, ``absent`` (not ready: name -> why), ``attempts`` (restarts made per instance,
    the supervisor's budget goes on from them) and which absent ones are still ``loading`` (never
    failed: they only came up late)."""

    urls: dict[str, str]
    ready: set[str]
    absent: dict[str, str]
    attempts: dict[str, int] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)


async def wait_for_instances(urls: Mapping[str, str], procs: ProcessSet, *, min_ready: int | float | None,
                             timeout_s: float, health_path: str = "/health", restart: Callable | None = None,
                             max_restarts: int = 0, interval_s: float = 0.25,
                             on_restarted: Callable[[], None] | None = None,
                             locate: Callable[[str], tuple[str | None, str, bool]] | None = None) -> StartupResult:
    """Poll every instance until :func:`startup_decision` says start (or raises).

    ``procs``: the children of this launcher; an instance among them that exits is failed with its
    own error line and, while ``restart`` is given and ``max_restarts`` allows, restarted at once
    (``restart(name) -> (child, url)``, blocking, run in a thread). An instance that is not a child
    here (another SLURM node's) is judged by ``/health`` and, with ``locate`` (``name -> (url now or
    None while unknown, why it is down or "", whether for good)``, what its node published), by the
    failure its node saw: an instance that could not bind its port is reported so, not as loading."""
    import aiohttp

    from dora_megatron.comm.http_session import HttpSession
    from dora_megatron.rollout.health import shared_checks

    urls = dict(urls)
    t0 = time.monotonic()
    ready: set[str] = set()
    failed: dict[str, str] = {}
    attempts: dict[str, int] = {}
    given_up: set[str] = set()
    restarting: dict[str, asyncio.Task] = {}

    def child_of(name: str) -> Child | None:
        return next((c for c in procs.children if c.name == name), None)

    async def probe(http: HttpSession, name: str) -> None:
        if "{port:" in urls[name]:  # its node has not published its port yet
            return
        try:
            async with http.session().get(urls[name].rstrip("/") + health_path) as resp:
                if resp.status == 200:
                    ready.add(name)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass

    async def do_restart(name: str) -> None:
        attempts[name] = attempts.get(name, 0) + 1
        log.warning("%s failed while the job starts (%s): restarting it (attempt %d of %d)", name, failed[name],
                    attempts[name], max_restarts)
        try:
            _, urls[name] = await asyncio.to_thread(restart, name)
            if on_restarted is not None:
                on_restarted()
        except Exception as err:  # noqa: BLE001 - the instance stays failed; the budget decides
            log.exception("restarting %s failed", name)
            failed[name] = f"{failed[name]}; its restart failed: {err}"

    http = shared_checks()  # at most 256 checks on the wire (thousands of instances may start)
    try:
        while True:
            pending = [n for n in urls if n not in ready and n not in given_up and n not in restarting]
            for name in pending:
                child = child_of(name)
                if locate is not None and (child is None or "{port:" in urls[name]):
                    url, why, final = locate(name)
                    urls[name] = url or urls[name]
                    if child is None and why:  # its node saw it fail (a child here tells by itself)
                        failed[name] = why
                        if final:
                            given_up.add(name)
                    elif child is None:
                        failed.pop(name, None)
                if child is None or child.alive():
                    continue
                failed[name] = exit_reason(child)
                if restart is not None and attempts.get(name, 0) < max_restarts:
                    restarting[name] = asyncio.get_running_loop().create_task(do_restart(name))
                    restarting[name].add_done_callback(lambda _t, n=name: restarting.pop(n, None))
                else:
                    given_up.add(name)
            await asyncio.gather(*(probe(http, n) for n in urls
                                   if n not in ready and n not in given_up and n not in restarting
                                   and (child_of(n) is None or child_of(n).alive())))
            for name in ready:
                failed.pop(name, None)
            retrying = {n for n in failed if n not in given_up}
            view = StartupView(len(urls), frozenset(ready), frozenset(set(urls) - ready - set(failed)),
                               dict(failed), frozenset(retrying), time.monotonic() - t0, timeout_s)
            if startup_decision(view, min_ready):
                absent = {n: failed.get(n, f"not healthy after {view.elapsed_s:.0f} s (still loading)")
                          for n in urls if n not in ready}
                return StartupResult(urls, set(ready), absent, dict(attempts), set(view.loading))
            await asyncio.sleep(interval_s)
    finally:  # a restart under way ends first (bounded: a kill and a start), so its child is known
        if restarting:
            await asyncio.gather(*list(restarting.values()), return_exceptions=True)
        await http.close()
