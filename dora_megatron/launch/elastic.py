"""Elastic rollout pools: new instances announce themselves, the controller adds them.

WHY files: a node added to a running job (a second ``sbatch``, see ``slurm/elastic_join.sbatch``)
shares only the run directory with the controller. Once its SGLang instance is healthy it writes
``<join_dir>/<name>.json`` (``{"name", "url", "gpus"}``, written atomically); the controller's
:func:`watch_joins` loop polls the folder, wraps each new URL in an engine adapter, checks it
answers, and calls ``Runtime.add_instance``, after which the orchestrator switches the instance to
the version it assigns (``Orchestrator.on_instance_joined``). Failed instances need nothing here:
the runtime's stats loop fails an instance whose ``/get_server_info`` errors or times out, and the
orchestrator re-runs its requests on their own version. An instance that its node's launcher
restarted (same name, same URL) asks again with a higher ``attempt``: the controller then treats
the old process as failed (if it had not noticed yet) and adds the new one; a restart made before
the run started (the request carries its time) replaced nothing the run used, and fails no one.

The controller also touches ``<join_dir>/controller.alive`` at every poll: a joining node that sees
no fresh heartbeat gives up after ``cluster.join_timeout_s`` instead of holding its node forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinRequest:
    name: str
    url: str
    gpus: int = 1
    attempt: int = 0  # restarts of this instance by its node's launcher
    #: wall time (``time.time()``) of the node's restart behind ``attempt`` (None: a first announcement)
    restarted_at: float | None = None


HEARTBEAT = "controller.alive"


def heartbeat_age(join_dir: str | Path) -> float | None:
    """Seconds since the controller last touched its heartbeat (None: it never did)."""
    import time

    try:
        return max(0.0, time.time() - (Path(join_dir) / HEARTBEAT).stat().st_mtime)
    except OSError:
        return None


def touch_heartbeat(join_dir: str | Path) -> None:
    p = Path(join_dir) / HEARTBEAT
    p.parent.mkdir(parents=True, exist_ok=True)
    p.touch()


def write_join_request(join_dir: str | Path, req: JoinRequest) -> Path:
    d = Path(join_dir)
    d.mkdir(parents=True, exist_ok=True)
    if "#" in req.name or "/" in req.name:
        raise ValueError(f"instance name {req.name!r} may not contain '#' or '/'")
    tmp = d / f".{req.name}.json.tmp"
    body = {"name": req.name, "url": req.url, "gpus": req.gpus, "attempt": req.attempt}
    if req.restarted_at is not None:
        body["restarted_at"] = req.restarted_at
    tmp.write_text(json.dumps(body))
    os.replace(tmp, d / f"{req.name}.json")
    return d / f"{req.name}.json"


def read_join_requests(join_dir: str | Path) -> list[JoinRequest]:
    out = []
    for p in sorted(Path(join_dir).glob("*.json")):
        try:
            d = json.loads(p.read_text())
            at = d.get("restarted_at")
            out.append(JoinRequest(str(d["name"]), str(d["url"]), int(d.get("gpus", 1)), int(d.get("attempt", 0)),
                                   None if at is None else float(at)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring malformed join request %s: %s", p, err)
    return out


async def watch_joins(join_dir: str | Path, runtime: Any, make_engine: Callable[[JoinRequest], Any], *,
                      poll_s: float = 5.0, probe: Callable[[Any], Awaitable[bool]] | None = None,
                      started_at: float | None = None) -> None:
    """Forever (until cancelled): add every new join request's instance to ``runtime``.

    ``probe(engine)`` (default: ``server_info()`` answers) must succeed before the instance is added;
    one that does not answer is retried at the next poll. ``started_at``: the wall time from which
    the controller sends work to the instances (its start-up wait is over). A restart its node made
    before then (an instance that died while the job started) left nothing to lose: the process the
    run started with at that URL is the restarted one, so a live instance is not failed for it; the
    request stays pending and brings the instance back if it fails later."""
    seen: set[tuple[str, int]] = set()
    while True:
        touch_heartbeat(join_dir)
        for req in read_join_requests(join_dir):
            key = (req.name, req.attempt)
            live = req.name in runtime.engines and not runtime.pool.is_failed(req.name)  # O(1) per request
            if key in seen or (live and req.attempt == 0):
                seen.add(key)
                continue
            if live and None not in (started_at, req.restarted_at) and req.restarted_at < started_at:
                continue
            engine = make_engine(req)
            try:
                ok = await (probe(engine) if probe is not None else _answers(engine))
            except Exception:  # noqa: BLE001 - not reachable yet
                ok = False
            if not ok:
                close = getattr(engine, "close", None)
                if close is not None:
                    await close()
                continue
            seen.add(key)
            old = runtime.engines.get(req.name)
            if old is not None and not runtime.pool.is_failed(req.name):
                # restarted by its node before the controller noticed: what ran on the old process is lost
                runtime.report_failure(req.name, f"restarted by its node's launcher (attempt {req.attempt})")
            runtime.add_instance(req.name, engine)
            close = getattr(old, "close", None)
            if close is not None:  # it pointed at the dead process
                try:
                    await close()
                except Exception:  # noqa: BLE001 - best effort
                    pass
        await asyncio.sleep(poll_s)


async def _answers(engine: Any) -> bool:
    await asyncio.wait_for(engine.server_info(), timeout=10)
    return True
