"""aiohttp application exposing an embedded engine with SGLang's HTTP protocol.

Why SGLang's protocol: the controller talks to SGLang and to this engine with one client.
The engine takes token ids only (like SGLang with ``--skip-tokenizer-init``).

SGLang endpoints: ``/generate``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/flush_cache``, ``/get_server_info`` (= ``/server_info``),
``/get_model_info`` (= ``/model_info``), ``/get_weight_version``, ``/health``,
``/health_generate``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/destroy_weights_update_group``, ``/update_weights_from_distributed``, ``/begin_weight_update`` and
``/end_weight_update`` (accepted: this engine has no in-place-quantized weights to restore, so a
session changes nothing here; SGLang >= 0.5.22 requires one around distributed updates), ``/v1/loads``
(``include=core`` fields: running/waiting requests, ``num_used_tokens``, ``max_total_num_tokens``,
``token_usage``).

Our extensions (not in SGLang), under ``/dora/``:
``POST /dora/export_request`` JSON ``{"rid"}`` -> binary body (torch.save of the request state,
KV tensor ``[layers, 2, kv_heads, tokens, head_dim]`` and sampler RNG state); the request leaves
this instance and its pending ``/generate`` answers with an abort whose ``err_type`` is
``"migrated"``. ``POST /dora/import_request`` binary body -> the ``/generate`` answer of the
request once it finishes here (``output_ids`` include the tokens made before the migration).
``/generate`` accepts ``dora_draft_sources`` (lists of token ids: the finished siblings of the
request's group, drafts for ``--speculative group``; kept through export/import);
``POST /dora/draft_sources`` JSON ``{"rid", "sources"}`` adds more to a running request (a sibling
that finished after it started) and answers ``{"added": bool}`` (false: the request has left).
``/generate`` accepts ``dora_keep_kv``: when the request finishes, its KV stays here for the next
turn of its trajectory (same rid, input continuing the kept tokens), bounded in time and blocks
(:mod:`~dora_megatron.rollout.engine.kept_kv`); ``POST /dora/export_kv`` JSON ``{"rid"}`` -> the
kept KV as a binary body (it leaves this instance; 404 when none is kept), ``POST /dora/import_kv``
binary body -> ``{"tokens"}`` (kept here; 409 for other weights, 507 without room),
``POST /dora/release_kv`` JSON ``{"rid"}`` -> ``{"released": bool}``.
``GET /dora/weights_checksum`` -> ``{"checksum", "weight_version"}`` (see
``dora_megatron.comm.checksum``). ``/generate`` accepts ``dora_version``: 409 if this
instance holds another weight version (so does an import of a request of another version).
Such pinned requests (``dora_version`` or imported) are aborted with ``status_code`` 409 and
``err_type`` ``"version_changed"`` if a weight update changes the version while they are still
here (possible only while paused): the C1 guard. Unpinned requests follow SGLang's semantics.
Unlike SGLang, ``/abort_request`` aborts only the exact rid when one matches (prefix match
otherwise) and answers 404 when nothing matches.

Credentials (:mod:`dora_megatron.comm.auth`): with keys, every route but ``/health`` and
``/health_generate`` needs ``Authorization: Bearer <key>`` (401 without, 403 with a wrong one);
:data:`ADMIN_PATHS` (SGLang 0.5.23's admin routes, and the dora extensions that move weights or
request state) need the admin key when one is set. Given ``weights_roots`` (a job's engine: the run
directory's snapshots), weights load only from under them or the model directory: 403 otherwise,
naming the rule.

Errors: malformed JSON, missing/mistyped fields, prompts too long, unknown rids, bad weights
answer 4xx with ``{"error": msg, "success": false, "message": msg}``; nothing else is affected.
Load: ``/generate`` answers 429 at once when ``max_waiting`` requests are already queued, so a
burst cannot grow the queue (and memory) without bound; JSON bodies are capped (413).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

from aiohttp import web

from dora_megatron.comm import auth
from dora_megatron.comm import protocol as P
from dora_megatron.comm import weight_group
from dora_megatron.rollout.engine.routing_trace import routing_trace_for
from dora_megatron.rollout.engine.runner import EngineRunner
from dora_megatron.rollout.engine.scheduler import Request, Scheduler

log = logging.getLogger(__name__)

DORA_EXTENSIONS = ("export_request", "import_request", "weights_checksum", "dora_version", "draft_sources",
                   "keep_kv")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: routes SGLang 0.5.23 marks ``AuthLevel.ADMIN_OPTIONAL`` (``sglang/srt/entrypoints/http_server.py``),
#: plus the dora extensions that read or replace weights or move a request's state between instances
ADMIN_PATHS = frozenset({
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
    "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
    "/dora/export_request", "/dora/import_request",
    "/dora/export_kv", "/dora/import_kv", "/dora/release_kv",
})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "success": False, "message": message}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except P.ProtocolError as exc:
        return _error(exc.status, exc.message)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
        log.exception("handler %s failed", request.path)
        return _error(500, f"internal error: {exc!r}")


# JSON bodies are small (a 128k-token prompt is about 1 MB); only /dora/import_request carries
# large binary bodies (up to the app's client_max_size). Bounding JSON bodies bounds the memory a
# burst of requests can pin.
MAX_JSON_BYTES = 64 << 20


async def _json(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
        raise P.ProtocolError(f"JSON body of {request.content_length} bytes exceeds {MAX_JSON_BYTES}", 413)
    chunks, size = [], 0
    while chunk := await request.content.read(1 << 20):  # also bounds chunked bodies
        size += len(chunk)
        if size > MAX_JSON_BYTES:
            raise P.ProtocolError(f"JSON body exceeds {MAX_JSON_BYTES} bytes", 413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise P.ProtocolError(f"malformed JSON body: {str(exc)[:200]}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else repr(exc)


@dataclass
class ServerOptions:
    model_path: str
    device: str = "cpu"
    group_timeout_s: float = 600.0
    group_connect_timeout_s: float = 30.0  # reaching the trainer's store; a bad address fails after this
    keys: auth.Keys = auth.Keys()  # no keys: every route open (a user's own `dora serve` on loopback)
    # where /update_weights_from_disk may read besides model_path (a job's snapshots); none: anywhere
    weights_roots: tuple[str, ...] = ()


class EngineServer:
    """Routes HTTP calls to the :class:`EngineRunner`; owns the weight-update groups."""

    def __init__(self, scheduler: Scheduler, options: ServerOptions) -> None:
        self.scheduler = scheduler
        self.options = options
        self.runner: EngineRunner | None = None
        self.groups: dict[str, Any] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[auth.aiohttp_middleware(self.options.keys, ADMIN_PATHS), error_middleware],
                              client_max_size=1 << 31)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path in ("/flush_cache",):
            r.add_post(path, self.flush_cache)
            r.add_get(path, self.flush_cache)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/weight_version", self.weight_version)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/begin_weight_update", self.weight_update_session)
        r.add_post("/end_weight_update", self.weight_update_session)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/dora/draft_sources", self.draft_sources)
        r.add_post("/dora/export_request", self.export_request)
        r.add_post("/dora/import_request", self.import_request)
        r.add_post("/dora/export_kv", self.export_kv)
        r.add_post("/dora/import_kv", self.import_kv)
        r.add_post("/dora/release_kv", self.release_kv)
        r.add_get("/dora/weights_checksum", self.weights_checksum)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.runner = EngineRunner(self.scheduler, asyncio.get_running_loop())
        self.runner.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self.runner is not None:
            self.runner.stop()
        for g in list(self.groups.values()):
            try:
                weight_group.destroy_weight_update_group(g)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                log.warning("could not destroy a weight update group", exc_info=True)

    @property
    def _runner(self) -> EngineRunner:
        assert self.runner is not None, "server not started"
        return self.runner

    # ---- generation ----------------------------------------------------------------------
    def _done_future(self) -> tuple["asyncio.Future[dict]", Callable[[dict], None]]:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        runner = self._runner
        return fut, lambda resp: runner.resolve(fut, resp)

    async def _await_result(self, fut: "asyncio.Future[dict]", rid: str) -> web.Response:
        try:
            resp = await fut
        except asyncio.CancelledError:
            # the client went away: free the slot
            self._runner.call(lambda s: s.abort(rid))
            raise
        return web.json_response(resp)

    async def generate(self, request: web.Request) -> web.Response:
        g = P.GenerateRequest.from_json(await _json(request))
        rid = g.rid or uuid.uuid4().hex
        fut, on_done = self._done_future()
        req = Request(
            rid=rid, prompt_ids=g.input_ids, params=g.sampling_params, return_logprob=g.return_logprob, on_done=on_done,
            draft_sources=g.dora_draft_sources, keep_kv=g.dora_keep_kv,
        )
        if g.return_routed_experts:
            req.routing = routing_trace_for(self._runner.scheduler.model.config, g.routed_experts_start_len)
        await self._runner.call(lambda s: s.submit(req, required_version=g.dora_version))
        return await self._await_result(fut, rid)

    async def abort_request(self, request: web.Request) -> web.Response:
        a = P.AbortRequest.from_json(await _json(request))
        n = await self._runner.call(lambda s: s.abort(a.rid, a.abort_all))
        if n == 0 and not a.abort_all:
            raise P.ProtocolError(f"unknown rid {a.rid!r} (no running or queued request matches)", 404)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)", "num_aborted": n})

    async def pause_generation(self, request: web.Request) -> web.Response:
        p = P.PauseRequest.from_json(await _json(request))
        n = await self._runner.call(lambda s: s.pause(p.mode))
        return web.json_response({"status": "ok", "message": f"paused ({p.mode}), {n} request(s) affected"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _json(request)
        await self._runner.call(lambda s: s.resume())
        return web.json_response({"status": "ok", "message": "generation continued"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._runner.call(lambda s: s.flush_cache())
        return web.json_response({"success": True, "message": "cache flushed"})

    # ---- info ----------------------------------------------------------------------------
    async def server_info(self, request: web.Request) -> web.Response:
        snap = dict(self._runner.snapshot)
        snap.update(
            {
                "model_path": self.options.model_path,
                "device": self.options.device,
                "engine": "dora-embedded",
                "dora_extensions": list(DORA_EXTENSIONS),
                "weight_update_groups": sorted(self.groups),
                "internal_states": [dict(self._runner.snapshot)],
                "last_error": self._runner.last_error,
            }
        )
        return web.json_response(snap)

    async def model_info(self, request: web.Request) -> web.Response:
        c = self.scheduler.model.config
        return web.json_response(
            {
                "model_path": self.options.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "weight_version": self._runner.snapshot["weight_version"],
                "model_type": c.model_type,
                "max_context_length": self.scheduler.max_context,
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        """One DP rank in SGLang's ``/v1/loads`` shape (token counts = KV blocks x block size)."""
        snap = self._runner.snapshot
        bs = int(snap.get("block_size", 1))
        used, total = int(snap.get("kv_blocks_used", 0)) * bs, int(snap.get("kv_blocks_total", 0)) * bs
        load = {"dp_rank": 0, "num_running_reqs": snap.get("num_running_reqs", 0),
                "num_waiting_reqs": snap.get("num_waiting_reqs", 0), "num_used_tokens": used,
                "max_total_num_tokens": total, "token_usage": round(used / total, 4) if total else 0.0,
                "max_running_requests": snap.get("max_running_requests", 0),
                **{k: v for k, v in snap.items() if k.startswith("spec_")}}
        return web.json_response({"loads": [load]})

    async def weight_update_session(self, request: web.Request) -> web.Response:
        await _json(request)
        return web.json_response({"success": True, "message": "Success"})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self._runner.snapshot["weight_version"]})

    async def health(self, request: web.Request) -> web.Response:
        if not self._runner.alive():
            return _error(503, "engine thread is not running")
        return web.json_response({"status": "ok"})

    # ---- weights -------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        u = P.UpdateFromDiskRequest.from_json(await _json(request))
        from dora_megatron.models import hf_model_dir

        roots = self.options.weights_roots
        try:
            if roots:  # an engine of a job (outside one, its user loads what they like)
                auth.inside(u.model_path, (self.options.model_path, *roots),
                            "weights load only from the model directory this engine started with or the job's "
                            f"snapshots ({', '.join(roots)})")
        except auth.OutsideJob as err:
            raise P.ProtocolError(str(err), 403) from None

        try:
            state = await asyncio.get_running_loop().run_in_executor(None, hf_model_dir.load_state_dict, u.model_path)
        except Exception as exc:  # noqa: BLE001 - whatever the client pointed at is not a model directory
            raise P.ProtocolError(f"cannot read weights from {u.model_path!r}: {str(exc)[:300]}") from None
        if u.abort_all_requests:
            await self._runner.call(lambda s: s.abort(abort_all=True))
        await self._runner.call_when_idle(lambda s: s.load_weights(state, u.weight_version, require_all=True))
        v = self._runner.scheduler.weight_version
        return web.json_response(
            {"success": True, "message": f"loaded {len(state)} tensors, weight_version {v}", "num_paused_requests": 0}
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        g = P.InitGroupRequest.from_json(await _json(request))
        if g.group_name in self.groups:
            raise P.ProtocolError(f"weight update group {g.group_name!r} already exists", 409)
        if g.backend == "nccl" and self.options.device != "cuda":
            raise P.ProtocolError("backend nccl needs --device cuda; use gloo on CPU")
        opts = self.options
        connect_s = min(opts.group_timeout_s, opts.group_connect_timeout_s)
        try:
            # TCPStore retries with back-off until connect_s; a peer that accepts but never answers
            # would block it for good, so wait on an abandonable thread with a bound of our own
            store = await asyncio.wait_for(
                weight_group.in_daemon_thread(
                    lambda: weight_group.connect_store(g.master_address, g.master_port, g.rank_offset, g.world_size, connect_s)
                ),
                3 * connect_s + 5,
            )
        except asyncio.TimeoutError:
            return _error(400, f"failed to join weight update group: no TCPStore answered at "
                               f"{g.master_address}:{g.master_port} within {3 * connect_s + 5:.0f} s")
        except Exception as exc:  # noqa: BLE001 - rendezvous failures are reported
            return _error(400, f"failed to join weight update group: {_first_line(exc)}")
        try:
            group = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: weight_group.group_from_store(
                    store, g.rank_offset, g.world_size, g.group_name, g.backend, opts.group_timeout_s
                ),
            )
        except Exception as exc:  # noqa: BLE001 - e.g. the other ranks never joined
            return _error(400, f"failed to join weight update group: {_first_line(exc)}")
        self.groups[g.group_name] = group
        return web.json_response({"success": True, "message": f"joined {g.group_name} as rank {g.rank_offset}"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = P.DestroyGroupRequest.from_json(await _json(request)).group_name
        if name not in self.groups:
            raise P.ProtocolError(f"unknown weight update group {name!r}", 404)
        weight_group.destroy_weight_update_group(self.groups.pop(name))
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        u = P.UpdateFromDistributedRequest.from_json(await _json(request))
        group = self.groups.get(u.group_name)
        if group is None:
            raise P.ProtocolError(f"unknown weight update group {u.group_name!r}; call /init_weights_update_group first")
        try:
            dtypes = [weight_group.parse_dtype(d) for d in u.dtypes]
        except ValueError as exc:
            raise P.ProtocolError(str(exc)) from None
        # check names and shapes before receiving: a wrong (or huge) shape must not allocate
        problems = self.scheduler.model.check_weights(
            {n: SimpleNamespace(shape=tuple(s)) for n, s in zip(u.names, u.shapes)}, require_all=False
        )
        if problems:
            raise P.ProtocolError("weights rejected before receiving, old weights kept: " + "; ".join(problems[:5]))
        device = self.scheduler.kv_shape.device
        if u.abort_all_requests:
            await self._runner.call(lambda s: s.abort(abort_all=True))

        def receive_and_load(s: Scheduler) -> int:
            tensors = weight_group.receive_tensors(group, u.shapes, dtypes, device)
            s.load_weights(dict(zip(u.names, tensors)), u.weight_version, require_all=False)
            return len(tensors)

        n = await self._runner.call_when_idle(receive_and_load)
        v = self._runner.scheduler.weight_version
        return web.json_response({"success": True, "message": f"updated {n} tensors, weight_version {v}"})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        checksum, version = await self._runner.call(lambda s: (s.weights_checksum(), s.weight_version))
        return web.json_response({"checksum": checksum, "weight_version": version})

    async def draft_sources(self, request: web.Request) -> web.Response:
        d = P.DraftSourcesRequest.from_json(await _json(request))
        added = await self._runner.call(lambda s: s.add_draft_sources(d.rid, d.sources))
        return web.json_response({"success": True, "added": added})

    # ---- migration -----------------------------------------------------------------------
    async def _export(self, request: web.Request, method: str) -> web.Response:
        """The binary body the scheduler's ``method`` serialises for the body's rid."""
        e = P.ExportRequest.from_json(await _json(request))
        data = await self._runner.call(lambda s: getattr(s, method)(e.rid))
        return web.Response(body=data, content_type="application/octet-stream")

    @staticmethod
    async def _exported(request: web.Request, by: str) -> bytes:
        data = await request.read()
        if not data:
            raise P.ProtocolError(f"empty body: expected the bytes returned by {by}")
        return data

    async def export_request(self, request: web.Request) -> web.Response:
        return await self._export(request, "export_request")

    async def import_request(self, request: web.Request) -> web.Response:
        data = await self._exported(request, "/dora/export_request")
        fut, on_done = self._done_future()
        req = await self._runner.call(lambda s: s.import_request(data, on_done))
        return await self._await_result(fut, req.rid)


    # ---- kept KV between a trajectory's turns ---------------------------------------------
    async def export_kv(self, request: web.Request) -> web.Response:
        return await self._export(request, "export_kept")

    async def import_kv(self, request: web.Request) -> web.Response:
        data = await self._exported(request, "/dora/export_kv")
        n = await self._runner.call(lambda s: s.import_kept(data))
        return web.json_response({"success": True, "tokens": n})

    async def release_kv(self, request: web.Request) -> web.Response:
        e = P.ExportRequest.from_json(await _json(request))
        released = await self._runner.call(lambda s: s.release_kept(e.rid))
        return web.json_response({"success": True, "released": released})


def build_app(
    model_path: str,
    *,
    device: str = "cpu",
    max_running: int = 32,
    weight_version: str = "0",
    block_size: int = 16,
    kv_blocks: int | None = None,
    max_context: int | None = None,
    dtype: Any = None,
    max_waiting: int | None = 4096,
    group_connect_timeout_s: float = 30.0,
    speculative: str = "off",
    spec_tokens: int = 4,
    spec_max_batch: int = 8,
    spec_token_cost: float = 0.25,
    spec_probe_interval: int = 64,
    spec_sibling_top_k: int = 32,
    kept_kv_s: float = 60.0,
    kept_kv_fraction: float = 0.25,
    keys: auth.Keys = auth.Keys(),
    weights_roots: tuple[str, ...] = (),
) -> web.Application:
    """Load the model and return the aiohttp application (the engine thread starts with it)."""
    from dora_megatron.rollout.engine.model import load_model
    from dora_megatron.rollout.engine.scheduler import SchedulerLimits

    import torch

    model = load_model(model_path, device=device, dtype=dtype or torch.float32)
    limits = SchedulerLimits(
        max_running=max_running, block_size=block_size, kv_blocks=kv_blocks, max_context=max_context, max_waiting=max_waiting,
        speculative=speculative, spec_tokens=spec_tokens, spec_max_batch=spec_max_batch,
        spec_token_cost=spec_token_cost, spec_probe_interval=spec_probe_interval,
        spec_sibling_top_k=spec_sibling_top_k, kept_kv_s=kept_kv_s, kept_kv_fraction=kept_kv_fraction,
    )
    sched = Scheduler(model, limits, weight_version=weight_version)
    options = ServerOptions(model_path=model_path, device=device, group_connect_timeout_s=group_connect_timeout_s,
                            keys=keys, weights_roots=tuple(weights_roots))
    return EngineServer(sched, options).app()
