"""Elastic rollout pools: new instances announce themselves, the controller adds them.

WHY files: a node added to a running job (a second ``sbatch``, see ``slurm/elastic_join.sbatch``)
shares only the run directory with the controller. Once its SGLang instance is healthy it writes
``<join_dir>/<name>.json`` (``{"name", "url", "gpus"}``, written atomically); the controller's
:func:`watch_joins` loop polls the folder, wraps each new URL in an engine adapter, checks it
answers, and calls ``Runtime.add_instance``, after which the orchestrator switches the instance to
the version it assigns (``Orchestrator.on_instance_joined``). Failed instances need nothing here:
the runtime's stats loop fails an instance whose ``/get_server_info`` errors or times out, and the
orchestrator re-runs its requests on their own version.
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


def write_join_request(join_dir: str | Path, req: JoinRequest) -> Path:
    d = Path(join_dir)
    d.mkdir(parents=True, exist_ok=True)
    if "#" in req.name or "/" in req.name:
        raise ValueError(f"instance name {req.name!r} may not contain '#' or '/'")
    tmp = d / f".{req.name}.json.tmp"
    tmp.write_text(json.dumps({"name": req.name, "url": req.url, "gpus": req.gpus}))
    os.replace(tmp, d / f"{req.name}.json")
    return d / f"{req.name}.json"


def read_join_requests(join_dir: str | Path) -> list[JoinRequest]:
    out = []
    for p in sorted(Path(join_dir).glob("*.json")):
        try:
            d = json.loads(p.read_text())
            out.append(JoinRequest(str(d["name"]), str(d["url"]), int(d.get("gpus", 1))))
        except (OSError, ValueError, KeyError) as err:
            log.warning("ignoring malformed join request %s: %s", p, err)
    return out


async def watch_joins(join_dir: str | Path, runtime: Any, make_engine: Callable[[JoinRequest], Any], *,
                      poll_s: float = 5.0, probe: Callable[[Any], Awaitable[bool]] | None = None) -> None:
    """Forever (until cancelled): add every new join request's instance to ``runtime``.

    ``probe(engine)`` (default: ``server_info()`` answers) must succeed before the instance is added;
    one that does not answer is retried at the next poll."""
    seen: set[str] = set()
    while True:
        for req in read_join_requests(join_dir):
            if req.name in seen or (req.name in runtime.engines and req.name not in runtime.failed):
                seen.add(req.name)
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
            seen.add(req.name)
            runtime.add_instance(req.name, engine)
        await asyncio.sleep(poll_s)


async def _answers(engine: Any) -> bool:
    await asyncio.wait_for(engine.server_info(), timeout=10)
    return True
