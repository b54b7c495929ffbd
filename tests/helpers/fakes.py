"""In-process fakes of an engine and the trainer for runtime unit tests.

The fake engine generates a deterministic answer for the running-sum prompt, one
token per ``token_s`` of (real, short) time, honours abort (partial output),
export/import (migration without recomputation), a trajectory's KV kept between its turns
(``keep_kv``: reused by the rid's next request that continues it, carried by export_kv/import_kv),
version tags (409 on
mismatch, like the real engine) and weight loads; it records everything it saw so
tests can check C1 and that migrated requests were not restarted.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import parse_running_sum_prompt, running_sum_answer
from dora_megatron.comm.engine_client import EngineError, VersionMismatch


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    target: list[int]
    produced: list[int]
    version: int
    done: asyncio.Future
    aborted: bool = False
    migrated: bool = False
    keep: bool = False


class FakeEngine:
    def __init__(self, name: str, token_s: float = 0.002, migration: bool = True, lengths: dict | None = None,
                 keep_kv: bool = False) -> None:
        self.name = name
        self.keep_kv = keep_kv
        self.kept: dict[str, tuple[list[int], int]] = {}  # rid -> (tokens its KV covers, version)
        self.base_url = f"fake://{name}"
        self.version = 0
        self.token_s = token_s
        self.migration = migration
        self.reqs: dict[str, _Req] = {}
        self.log: list[tuple[str, str, int]] = []  # (op, rid, version)
        self.dead = False
        self.loads: list[str] = []

    def _check(self) -> None:
        if self.dead:
            raise EngineError(self.name, 503, "dead")

    async def supports(self, name: str) -> bool:
        return (self.migration and name in ("export_request", "import_request")) or (self.keep_kv and name == "keep_kv")

    async def server_info(self) -> dict[str, Any]:
        self._check()
        return {"num_running_reqs": len(self.reqs), "kv_usage": 0.1 * len(self.reqs), "weight_version": str(self.version)}

    async def update_weights_from_disk(self, model_path: str, weight_version=None) -> dict[str, Any]:
        self._check()
        assert not self.reqs, f"{self.name}: switch while holding {list(self.reqs)}"
        await asyncio.sleep(0.005)
        if int(weight_version) != self.version:
            self.kept.clear()  # computed with the old weights
        self.version = int(weight_version)
        self.loads.append(model_path)
        return {"success": True}

    @staticmethod
    def _answer(input_ids: list[int]) -> list[int]:
        digits = parse_running_sum_prompt(tok.decode(input_ids))
        return tok.encode(running_sum_answer(digits) + ".") + [tok.EOS_ID]

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       keep_kv=False):
        self._check()
        assert not keep_kv or self.keep_kv, "keep_kv sent to an engine that does not offer it"
        if version is not None and int(version) != self.version:
            raise VersionMismatch(self.name, 409, f"weight version {self.version} != requested {version}")
        full = self._answer(list(input_ids))
        prompt_len = len(tok.encode(tok.decode(input_ids).split(":")[0] + ":", add_bos=True))
        already = len(input_ids) - prompt_len
        req = _Req(rid, list(input_ids), full[already:], [], self.version, asyncio.get_running_loop().create_future(),
                   keep=keep_kv)
        self.reqs[rid] = req
        self.log.append(("generate", rid, self.version))
        kept = self.kept.pop(rid, None)
        if kept is not None and kept[1] == self.version and list(input_ids[:len(kept[0])]) == kept[0]:
            self.log.append(("reuse", rid, self.version))  # its prefix was not computed again
        return await self._run(req)

    def _token_time(self, req: _Req) -> float:
        """Seconds per generated token of ``req`` (subclasses slow some requests down)."""
        return self.token_s

    async def _run(self, req: _Req):
        try:  # a request whose client went away (its task cancelled) leaves the engine, as on a server
            while len(req.produced) < len(req.target) and not req.aborted and not req.migrated:
                await asyncio.sleep(self._token_time(req))
                if self.dead:
                    raise EngineError(self.name, 503, "dead")
                if req.aborted or req.migrated:
                    break
                req.produced.append(req.target[len(req.produced)])
        finally:
            if self.reqs.get(req.rid) is req:
                self.reqs.pop(req.rid)
        reason = "abort" if req.aborted else "stop"
        if req.keep and reason == "stop" and not req.migrated:
            self.kept[req.rid] = (req.input_ids + req.produced[:-1], self.version)
        # what the runtime reads of an answer (events.answer.EngineAnswer); no versions_used: the
        # fake reports none, the runtime records the versions it submitted on
        return SimpleNamespace(output_ids=list(req.produced), output_token_logprobs=[-0.5] * len(req.produced),
                               finish_reason={"type": reason}, migrated=req.migrated, weight_version=str(req.version),
                               versions_used=[], token_arrays=None, raw={})

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        hit = False
        for r in list(self.reqs.values()):
            if abort_all or r.rid == rid:
                r.aborted = True
                hit = True
        return hit

    async def export_request(self, rid: str) -> bytes:
        self._check()
        req = self.reqs.get(rid)
        if req is None:
            raise EngineError(self.name, 404, f"unknown rid {rid}")
        req.migrated = True
        self.reqs.pop(rid)
        self.log.append(("export", rid, req.version))
        return pickle.dumps({"rid": rid, "input_ids": req.input_ids, "target": req.target, "produced": req.produced,
                             "version": req.version, "keep": req.keep})

    async def import_request(self, blob: bytes):
        self._check()
        d = pickle.loads(blob)
        assert d["version"] == self.version, "imported a request of another version"
        req = _Req(d["rid"], d["input_ids"], d["target"], list(d["produced"]), self.version,
                   asyncio.get_running_loop().create_future(), keep=d["keep"])
        self.reqs[req.rid] = req
        self.log.append(("import", req.rid, self.version))
        return await self._run(req)

    async def export_kv(self, rid: str) -> bytes:
        self._check()
        if rid not in self.kept:
            raise EngineError(self.name, 404, f"no kept KV for {rid}")
        tokens, version = self.kept.pop(rid)
        self.log.append(("export_kv", rid, version))
        return pickle.dumps({"rid": rid, "tokens": tokens, "version": version})

    async def import_kv(self, blob: bytes) -> int:
        self._check()
        d = pickle.loads(blob)
        if d["version"] != self.version:
            raise VersionMismatch(self.name, 409, f"weight version {self.version} != {d['version']}")
        self.kept[d["rid"]] = (d["tokens"], d["version"])
        self.log.append(("import_kv", d["rid"], self.version))
        return len(d["tokens"])

    async def release_kv(self, rid: str) -> bool:
        self._check()
        return self.kept.pop(rid, None) is not None

    async def weights_checksum(self) -> str:
        return "x"


class FakeTrainer:
    routed_spool = None  # no batch files: routed experts travel in the batch (controller.records.Trainer)

    def __init__(self, train_s: float = 0.01, engines: dict | None = None, push_s: float = 0.0) -> None:
        self.engines = {e.base_url: e for e in (engines or {}).values()}
        self.push_s = push_s  # how long one broadcast takes
        self.pushes: list[tuple[int, list[str]]] = []
        self.push_args: list[dict] = []
        self.version = 0
        self.batches: list[list[dict]] = []
        self.train_s = train_s
        self.checkpoints: list[str] = []
        self._holds: dict[int, tuple[Any, float]] = {}
        self.holding: int | None = None  # the held step being waited in (:meth:`hold_step`)

    def hold_step(self, step: int, until, limit_s: float = 10.0) -> None:
        """Start training ``step`` only once ``until()`` is true (or ``limit_s`` passed). These runs
        last a fraction of a second: on a loaded machine the rest of a run could otherwise finish
        before the event a test is about (a timeout, a rejoin serving work) happens at all."""
        self._holds[step] = (until, limit_s)

    async def train(self, step: int, samples: list) -> dict:
        assert step == self.version, (step, self.version)
        if step in self._holds:
            until, limit_s = self._holds[step]
            self.holding = step  # a test may act once the step is really under way
            deadline = asyncio.get_running_loop().time() + limit_s
            while not until() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
        await asyncio.sleep(self.train_s)
        self.batches.append(samples)
        self.version += 1
        return {"version": self.version, "metrics": {"loss": 0.0}, "checksum": None}

    async def push_weights(self, engines: list[str], bucket_mb: float, master_addr: str | None = None,
                           timeout_s: float | None = None, gpus: dict[str, int] | None = None,
                           pause_mode: str | None = None, master_port: int | None = None,
                           backend: str | None = None) -> dict:
        self.push_args.append({"bucket_mb": bucket_mb, "master_addr": master_addr, "master_port": master_port,
                               "gpus": gpus, "pause_mode": pause_mode, "backend": backend})
        await asyncio.sleep(self.push_s)
        for url in engines:
            e = self.engines[url]
            assert not e.reqs, f"{e.name}: push while holding {list(e.reqs)}"
            e.version = self.version
        self.pushes.append((self.version, list(engines)))
        return {"bytes": 1000 * len(engines), "version": self.version, "checksum": None}

    async def save_checkpoint(self, path: str) -> dict:
        self.checkpoints.append(path)
        return {"path": path}


async def fail_after_first_step(rt, trainer: FakeTrainer, engine: FakeEngine, name: str) -> None:
    """Once the first batch is trained, make ``engine`` (instance ``name``) unreachable; return when
    the runtime has marked the instance failed (a test then lets it rejoin)."""
    while len(trainer.batches) < 1:
        await asyncio.sleep(0.005)
    engine.dead = True
    while name not in rt.pool.failed:
        await asyncio.sleep(0.005)


class FakePool:
    """The part of :class:`~dora_megatron.controller.pool.Pool` a supervisor uses: what it sets
    (``engine_restarts``, ``instances_may_return``) and what it asks per poll. ``failed`` (the
    whole set, O(pool)) raises: a poller asks ``is_failed`` / ``all_failed``."""

    def __init__(self, engines: dict, down: set[str]) -> None:
        self.engines, self.down = engines, down
        self.engine_restarts: int | None = None
        self.instances_may_return = False

    @property
    def failed(self):
        raise AssertionError("a poller built the whole failed set")

    def is_failed(self, name):
        return name in self.down

    def all_failed(self):
        return bool(self.engines) and set(self.engines) <= self.down


class FakeRuntime:
    """The part of :class:`~dora_megatron.controller.runtime.Runtime` a supervisor uses: its clients,
    its ``pool`` (:class:`FakePool`), the run's end (a real :class:`~dora_megatron.controller.run_tasks.RunTasks`)
    and the two events a launcher posts; tests read ``down`` and ``added``."""

    def __init__(self, names):
        from dora_megatron.controller.loop import EventQueue
        from dora_megatron.controller.run_tasks import RunTasks

        self.engines = {n: f"client-of-{n}" for n in names}
        self.down: set[str] = set()
        self.added: list[tuple[str, str]] = []
        self.pool = FakePool(self.engines, self.down)
        self.tasks = RunTasks(EventQueue())

    def report_failure(self, name, why, engine=None):
        self.down.add(name)

    def add_instance(self, name, engine):
        self.engines[name] = engine
        self.down.discard(name)
        self.added.append((name, engine))
