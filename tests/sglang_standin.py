"""A stand-in for an SGLang 0.5.23 server, for the SGLang-path tests on CPU.

``python tests/sglang_standin.py <SGLang flags>`` (``--model-path --host --port --weight-version
--max-running-requests --load-format --speculative-algorithm --speculative-draft-model-path``; other flags are accepted and ignored) runs dora's embedded
engine in this process on a private loopback port, for the arithmetic, and serves in front of it
the HTTP surface of SGLang 0.5.23 as its source says it behaves. Each behaviour below cites the
file of SGLang 0.5.23 it models (paths under ``sglang/srt/``); no SGLang code is used or copied.

* no ``/dora/*`` route and no ``dora_extensions``: SGLang has none;
* a paused server holds every new ``/generate`` until ``/continue_generation`` after registering
  its rid (``managers/tokenizer_manager.py`` ``generate_request``: ``_init_req_state``, then the
  wait on ``is_pause_cond``); the pause outlives ``/update_weights_from_disk`` (nothing but
  ``continue_generation`` clears ``is_pause``);
* ``/abort_request`` answers 200 with an empty body, matched or not (``entrypoints/http_server.py``),
  drops the abort of a rid the tokenizer has not registered, and sends one abort per rid at most
  (``tokenizer_manager.py`` ``abort_request``: ``rid_to_state`` lookup, ``abort_sent``);
* ``/update_weights_from_distributed`` answers 400 outside a ``/begin_weight_update`` ..
  ``/end_weight_update`` session, before touching the group (so a trainer's broadcast waits for a
  peer that never joins); begin twice or end without begin answer 400
  (``managers/scheduler_components/weight_updater.py``);
* every successful update call with ``weight_version`` sets it (each bucket, not only the last;
  ``weight_updater.py`` ``record_weight_version_after_update``, ``tokenizer_control_mixin.py``);
* ``flush_cache`` after an update, and ``/flush_cache``, succeed only when nothing runs and nothing
  waits, waiting requests not counted while a ``retract``/``in_place`` pause holds the scheduler
  (``managers/scheduler.py`` ``flush_cache``: ``is_fully_idle(ignore_waiting=_engine_paused)``); a
  refused flush fails the update call with SGLang's message (``weight_updater.py``
  ``flush_cache_after_weight_update``); ``/flush_cache`` answers plain text
  (``entrypoints/http_server.py``);
* ``/update_weights_from_disk`` without ``load_format`` uses the server's ``--load-format``
  (``tokenizer_manager.py`` ``update_weights_from_disk``); with ``dummy`` the update does not load
  the directory, which here answers 400;
* ``/v1/loads``: per DP rank ``num_used_tokens``, ``num_total_tokens`` = used + tokens of the
  waiting requests (not the pool size), ``max_total_num_tokens`` (the pool), ``token_usage``
  (``managers/scheduler_components/load_inquirer.py``, ``entrypoints/v1_loads.py``);
* ``/model_info`` answers from the tokenizer side; ``/get_server_info`` goes to the scheduler, so it
  waits while a weight update runs (``entrypoints/http_server.py``: ``get_internal_state``);
* ``/weights_checker`` with ``action=checksum``: ``per_engine_checksum``, a sha256 over per-GPU
  checksums (``managers/tokenizer_control_mixin.py`` ``check_weights``), so it never equals a
  trainer-side checksum, only another instance's;
* a draft model (``--speculative-algorithm EAGLE`` or ``NEXTN``; NGRAM has none) is a runner of
  its own: ``/begin_weight_update`` and ``/update_weights_from_distributed`` load the runners their
  ``selector`` names (``target``, ``draft`` or ``all``, the default), each handed the same received
  tensors (``weight_updater.py`` ``_select_runners``, ``update_weights_from_distributed``;
  ``speculative/base_spec_worker.py`` ``weight_update_runners``: none without a draft worker);
  tensors handed to the draft change it here (an EAGLE3 draft takes the target's
  ``model.layers.0.*`` as its own layer, ``models/llama_eagle3.py`` ``load_weights``);
  ``/weights_checker`` lists the draft's checksum under ``draft.``-prefixed keys and hashes it into
  ``per_gpu_checksum`` (``weight_updater.py`` ``_merge_checksum_payloads``). Disk updates, which
  reload every runner, leave this draft as it is: the drafts dora accepts keep nothing of a dora
  snapshot (docs/sglang.md, "Speculative decoding");
* ``SGLANG_STANDIN_WITHOUT`` (comma-separated paths) leaves those routes out (404), as a build or
  launch mode without an optional endpoint;
* ``--api-key`` / ``--admin-api-key`` (also from ``--config`` YAML, ``server_args.py``
  ``prepare_server_args``) are enforced by 0.5.23's own decision function and route levels, read
  from the wheel (``utils/auth.py`` ``decide_request_auth``, the ``@auth_level`` decorators of
  ``entrypoints/http_server.py``): ``/health*`` open, a missing or wrong key 401, an admin route
  without an ``--admin-api-key`` configured takes ``--api-key``;
* ``meta_info.weight_versions`` spans on every ``/generate`` answer (``utils/weight_versions.py``),
  from the embedded engine, which records them the same way.

Request bodies are validated with SGLang's own request types from the wheel when it is installed
(``tests/sglang_wheel.py``), answering 400 with an ``ErrorResponse`` as 0.5.23's handler of FastAPI's
validation errors does; unknown routes answer Starlette's JSON 404. ``tests/integration/
test_sglang_conformance.py`` compares every answer here with the real server's, shape by shape.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

log = logging.getLogger("sglang_standin")


@dataclass
class _ReqState:
    """One registered request (``tokenizer_manager.py`` ``ReqState``): what an abort can find."""

    prompt_tokens: int
    abort_sent: bool = False
    forwarded: bool = False


@dataclass
class StandIn:
    engine_url: str
    load_format: str
    http: ClientSession
    is_pause: bool = False
    engine_paused: bool = False  # the scheduler's _engine_paused: only retract / in_place set it
    session: dict[str, Any] | None = None
    rid_to_state: dict[str, _ReqState] = field(default_factory=dict)
    schemas: Any = None
    draft: str | None = None  # checksum of the draft runner's weights; None: no draft runner
    pause_changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    updating: asyncio.Lock = field(default_factory=asyncio.Lock)

    # ---- plumbing ------------------------------------------------------------------------
    async def engine(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(method, self.engine_url + path, json=body) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw) if raw else {}
            except ValueError:
                return resp.status, {"message": raw.decode(errors="replace")}

    async def body(self, request: web.Request, route: str) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise bad_request(f"1 validation error: JSON decode error: {exc}") from None
        if self.schemas is not None:
            from tests.sglang_wheel import SchemaError

            try:
                self.schemas.validate(route, body)
            except SchemaError as exc:
                raise bad_request(str(exc)) from None
        return body

    async def idle(self) -> bool:
        """``scheduler.py`` ``is_fully_idle(ignore_waiting=self._engine_paused)``."""
        _, info = await self.engine("GET", "/get_server_info")
        return int(info.get("num_running_reqs", 0)) == 0 and (
            self.engine_paused or int(info.get("num_waiting_reqs", 0)) == 0)

    async def flush_after_update(self, body: dict[str, Any], ok: bool, message: str) -> tuple[bool, str]:
        """``weight_updater.py`` ``flush_cache_after_weight_update``."""
        if ok and body.get("flush_cache", True) and not await self.idle():
            return False, ("Weights were updated, but the cache was not flushed because requests are still running "
                           "or queued. Retract or finish them, then call /flush_cache.")
        return ok, message

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/generate")
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self.rid_to_state:
            return web.json_response({"error": {"message": f"Duplicate request ID: {rid}"}}, status=400)
        state = self.rid_to_state[rid] = _ReqState(len(body.get("input_ids") or ()))
        try:
            async with self.pause_changed:
                await self.pause_changed.wait_for(lambda: not self.is_pause)
            state.forwarded = True
            status, out = await self.engine("POST", "/generate", {**body, "rid": rid})
        finally:
            self.rid_to_state.pop(rid, None)
        if status >= 400:
            return web.json_response({"error": {"message": out.get("message")}}, status=status)
        meta = out.get("meta_info") or {}
        for k in [k for k in meta if k.startswith("dora_")]:
            del meta[k]
        out["meta_info"] = sglang_meta_info(meta, bool(body.get("return_logprob")))
        return web.json_response(out)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/abort_request")
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all"))
        if abort_all:
            await self.engine("POST", "/abort_request", {"abort_all": True})
        elif rid:
            state = self.rid_to_state.get(rid)
            if state is not None and not state.abort_sent:
                state.abort_sent = True
                # SGLang sends it to the scheduler even when the request is not there (still held by
                # a pause): it is lost then. Once the request was sent on, SGLang's ordered
                # tokenizer -> scheduler channel delivers the abort after it; this stand-in's own
                # HTTP hop to the engine is not ordered that way, so it retries across that hop only.
                for _ in range(100):
                    status, _ = await self.engine("POST", "/abort_request", {"rid": rid})
                    if status != 404 or not state.forwarded or rid not in self.rid_to_state:
                        break
                    await asyncio.sleep(0.01)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/pause_generation")
        mode = body.get("mode", "abort")
        async with self.pause_changed:
            self.is_pause = True
        await self.engine("POST", "/pause_generation", {"mode": mode})
        self.engine_paused = mode in ("retract", "in_place")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.body(request, "/continue_generation")
        await self.engine("POST", "/continue_generation", {})
        self.engine_paused = False
        async with self.pause_changed:
            self.is_pause = False
            self.pause_changed.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self.idle():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")
        return web.Response(text="Flush cache failed.\n", status=400)

    # ---- weights -------------------------------------------------------------------------
    @staticmethod
    def _result(ok: bool, message: str, **extra: Any) -> web.Response:
        return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/begin_weight_update")
        if self.session is not None:
            return self._result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = {"selector": body.get("selector", "all"), "loaded_weights": False}
        return self._result(True, "Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self.body(request, "/end_weight_update")
        if self.session is None:
            return self._result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = None
        return self._result(True, "Success")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/update_weights_from_distributed")
        if self.session is None:
            return self._result(False, "update_weights_from_distributed must run between begin_weight_update() "
                                       "and end_weight_update()")
        if body.get("abort_all_requests"):
            await self.engine("POST", "/abort_request", {"abort_all": True})
        async with self.updating:
            status, out = await self.engine("POST", "/update_weights_from_distributed", body)
            ok, message = status < 400, str(out.get("message"))
            if ok:
                self.session["loaded_weights"] = True
                if self.draft is not None and body.get("selector", "all") in ("all", "draft"):
                    self.draft = hashlib.sha256((self.draft + ",".join(body["names"])).encode()).hexdigest()
            ok, message = await self.flush_after_update(body, ok, message)
        return self._result(ok, message)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/update_weights_from_disk")
        load_format = body.get("load_format") or self.load_format
        if load_format == "dummy":
            return self._result(False, f"Failed to update weights: load format {load_format!r} does not read "
                                       f"{body.get('model_path')!r}", num_paused_requests=0)
        if body.get("abort_all_requests"):
            await self.engine("POST", "/abort_request", {"abort_all": True})
        async with self.updating:
            status, out = await self.engine("POST", "/update_weights_from_disk", body)
            ok, message = await self.flush_after_update(body, status < 400, str(out.get("message")))
        return self._result(ok, message, num_paused_requests=0)

    async def forward(self, request: web.Request) -> web.Response:
        body = await self.body(request, request.path)
        status, out = await self.engine("POST", request.path, body)
        return self._result(status < 400, str(out.get("message")))

    async def weights_checker(self, request: web.Request) -> web.Response:
        body = await self.body(request, "/weights_checker")
        if body.get("action", "checksum") != "checksum":
            return self._result(False, f"unsupported action {body.get('action')!r} in this stand-in")
        _, out = await self.engine("GET", "/dora/weights_checksum")
        checksums = {} if self.draft is None else {"draft.model": self.draft}
        per_gpu = hashlib.sha256(f"tp0:{out['checksum']}:{checksums}".encode()).hexdigest()
        return web.json_response({"success": True, "message": "Success.",
                                  "ranks": [{"checksums": checksums, "per_gpu_checksum": per_gpu,
                                             "parallelism_info": []}],
                                  "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()})

    # ---- info ----------------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        """``entrypoints/http_server.py`` ``model_info``: what a generation model without parsers,
        multimodal inputs or disaggregation answers; ``embedding`` is the embedding-serving plan
        0.5.23 resolves for every model (off for a generation model)."""
        _, out = await self.engine("GET", "/model_info")
        path = out.get("model_path")
        try:
            archs = json.loads((Path(str(path)) / "config.json").read_text()).get("architectures")
        except (OSError, ValueError):
            archs = None
        return web.json_response({"model_path": path, "served_model_name": path, "tokenizer_path": path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": out.get("weight_version"), "load_format": self.load_format,
                                  "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                                  "has_image_understanding": False, "has_audio_understanding": False,
                                  "model_type": out.get("model_type"), "architectures": archs,
                                  "embedding": EMBEDDING_OFF})

    async def server_info(self, request: web.Request) -> web.Response:
        async with self.updating:  # the scheduler answers it, and it is busy loading weights
            _, out = await self.engine("GET", "/get_server_info")
        return web.json_response({"internal_states": [{"weight_version": out.get("weight_version")}],
                                  "version": "0.5.23"})

    async def loads(self, request: web.Request) -> web.Response:
        """``entrypoints/v1_loads.py`` ``get_loads`` over ``managers/load_snapshot.py``
        ``LoadSnapshot.to_dict``: the core keys always, the sections unless ``include`` leaves them
        out (``core`` alone: none). Counters the embedded engine does not keep (throughput, cache
        hits, prefill time, decode step-time moments) read 0; ``accelerator`` is null and ``num_accelerators`` 1, as on CPU."""
        include = {x.strip() for x in request.query["include"].split(",")} if request.query.get("include") else None
        if include is not None and not include <= LOAD_SECTIONS:
            return web.json_response(error_body(f"Invalid include sections: {include - LOAD_SECTIONS}. "
                                                f"Valid options: {sorted(LOAD_SECTIONS)}", type_="400"), status=400)
        _, out = await self.engine("GET", "/v1/loads")
        loads = []
        waiting_tokens = sum(s.prompt_tokens for s in self.rid_to_state.values() if s.forwarded)
        for load in out.get("loads", []):
            used = int(load["num_used_tokens"])
            waiting = int(load["num_waiting_reqs"])
            pool = int(load["max_total_num_tokens"])
            total = used + (waiting_tokens if waiting else 0)
            entry = {"timestamp": time.time(), "dp_rank": int(load["dp_rank"]),
                     "num_running_reqs": int(load["num_running_reqs"]), "num_waiting_reqs": waiting,
                     "num_waiting_uncached_tokens": waiting_tokens if waiting else 0, "num_used_tokens": used,
                     "num_total_tokens": total, "num_active_tokens": total, "num_prealloc_ready_tokens": 0,
                     "max_total_num_tokens": pool, "max_running_requests": int(load["max_running_requests"]),
                     "token_usage": float(load["token_usage"]), "gen_throughput": 0.0, "cache_hit_rate": 0.0,
                     "utilization": 0.0, "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
                     "decode_moments": [0.0] * 6}  # sums of decode step-time moments: a list once
                                                    # a decode ran (SGLang's warm-up runs one)
            sections = {"memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": pool},
                        "disaggregation": {"mode": "null", "prefill_bootstrap_queue_reqs": 0,
                                           "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                           "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                           "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
                        "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}}
            wanted = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}
            for key, name in wanted.items():
                if include is None or "all" in include or name in include:
                    entry[key] = sections[key]
            loads.append(entry)
        return web.json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": "0.5.23",
                                  "accelerator": None, "num_accelerators": 1, "loads": loads})

    async def health(self, request: web.Request) -> web.Response:
        status, _ = await self.engine("GET", "/health")
        return web.Response(status=200 if status == 200 else 503)

    def app(self, api_key: str | None = None, admin_api_key: str | None = None) -> web.Application:
        keys = [_auth_middleware(api_key, admin_api_key)] if api_key or admin_api_key else []
        app = web.Application(client_max_size=1 << 28, middlewares=[*keys, starlette_errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.forward)
        r.add_post("/destroy_weights_update_group", self.forward)
        r.add_route("*", "/weights_checker", self.weights_checker)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        return app


def _auth_middleware(api_key: str | None, admin_api_key: str | None):
    """0.5.23's key check in front of every route (the wheel's own decision; without the wheel, the
    same levels from dora's :data:`~dora_megatron.rollout.engine.server.ADMIN_PATHS`)."""
    from tests.sglang_wheel import load_auth

    wheel = load_auth()

    def decide(request: web.Request) -> int | None:
        authz = request.headers.get("Authorization")
        if wheel is not None:
            return wheel.decide(request.method, request.path, authz, api_key, admin_api_key)
        from dora_megatron.comm import auth
        from dora_megatron.rollout.engine.server import ADMIN_PATHS

        status = auth.Keys(api_key, admin_api_key).decide(request.path, request.path in ADMIN_PATHS, authz)
        return None if status is None else 401  # SGLang answers 401 to a wrong key too

    @web.middleware
    async def check(request: web.Request, handler):
        status = decide(request)
        if status is not None:
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    return check


@web.middleware
async def starlette_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown route or method answers as Starlette's default handler does (FastAPI's
    ``HTTPException`` handler of ``http_server.py`` does not see routing errors): JSON ``detail``."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def error_body(message: str, type_: str = "Bad Request") -> dict[str, Any]:
    """``entrypoints/openai/protocol.py`` ``ErrorResponse``, as ``http_server.py``'s exception
    handlers answer (``type``: the status phrase for a validation error, the code for an HTTPException)."""
    return {"object": "error", "message": message, "type": type_, "param": None, "code": 400}


def bad_request(message: str) -> web.HTTPBadRequest:
    """A body FastAPI refuses: 400 (not FastAPI's 422: ``http_server.py``
    ``validation_exception_handler`` answers every ``RequestValidationError`` so), an ``ErrorResponse``."""
    return web.HTTPBadRequest(text=json.dumps(error_body(message)), content_type="application/json")


#: ``/v1/loads?include=`` sections (``load_snapshot.py`` ``LoadSnapshot.VALID_SECTIONS``)
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

#: ``/model_info``'s ``embedding`` for a generation model: the embedding-serving plan switched off
#: (``http_server.py`` ``model_info``: ``resolved_embedding_plan``), with fewer of the CUDA-graph
#: batch sizes it lists (the shape is a list of numbers either way)
EMBEDDING_OFF: dict[str, Any] = {
    "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
    "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
    "enabled": False, "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096,
            "capture_batch_sizes": [4, 8, 12, 16, 20, 24, 28, 32, 48, 64]},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
}


def sglang_meta_info(meta: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
    """The embedded engine's ``meta_info`` with what 0.5.23 adds to a ``/generate`` answer of one
    request on one DP rank without speculative decoding or reasoning parser
    (``managers/tokenizer_manager.py`` ``_handle_batch_output``): retractions, the prompt's
    log-probs (none: ``logprob_start_len`` -1 starts at the last prompt token, which has no
    output), the cached-token split (``null`` when nothing was cached), the time the answer left.
    A user's abort has no status code there (``schedule_batch.py`` ``FINISH_ABORT``)."""
    out = dict(meta)
    out.update(num_retractions=0, reasoning_tokens=0, dp_rank=None, response_sent_to_client_ts=time.time())
    cached = int(meta.get("cached_tokens") or 0)
    out["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
    if return_logprob:
        out["input_token_logprobs"] = []
        out["output_token_logprobs_length"] = len(meta.get("output_token_logprobs") or ())
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("status_code") == 200:
        out["finish_reason"] = {**reason, "message": "Aborted", "status_code": None}
    return out


def without_routes(app: web.Application, paths: set[str]) -> web.Application:
    """``app`` less the routes at ``paths`` (they answer 404): an SGLang build or launch mode
    without an optional endpoint (``SGLANG_STANDIN_WITHOUT``, comma-separated paths)."""
    if not paths:
        return app
    kept = web.Application(client_max_size=app._client_max_size, middlewares=app.middlewares)
    for route in app.router.routes():
        if route.resource is not None and route.resource.canonical not in paths:
            kept.router.add_route(route.method, route.resource.canonical, route.handler)
    return kept


@dataclass
class StandInProcess:
    """A stand-in started by a test (:func:`start_standin`); :meth:`stop` ends it by pid."""

    url: str
    proc: Any
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_standin(model_dir: str, log_dir: Path, *, name: str = "sgl", weight_version: str = "0",
                  load_format: str = "auto", max_running: int = 8, timeout_s: float = 180.0,
                  without: tuple[str, ...] = (), extra_args: tuple[str, ...] = ()) -> StandInProcess:
    """Start one stand-in on a free loopback port and wait (bounded) until ``/health`` answers 200.
    ``without``: routes it does not offer (404), as an SGLang build or launch mode without them;
    ``extra_args``: more SGLang flags (``--speculative-algorithm`` ...)."""
    import subprocess
    import time
    import urllib.request

    from dora_megatron.ports import free_port

    port = free_port()
    log_path = Path(log_dir) / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--weight-version", str(weight_version), "--load-format", load_format,
           "--max-running-requests", str(max_running), *extra_args]
    with open(log_path, "wb") as out:
        env = {**os.environ, "SGLANG_STANDIN_WITHOUT": ",".join(without)} if without else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    inst = StandInProcess(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"stand-in exited ({proc.returncode}):\n{inst.log()[-3000:]}")
        try:
            with urllib.request.urlopen(inst.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return inst
        except OSError:
            pass
        if time.monotonic() > deadline:
            inst.stop()
            raise RuntimeError(f"stand-in not healthy after {timeout_s:.0f} s:\n{inst.log()[-3000:]}")
        time.sleep(0.2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SGLang 0.5.23 stand-in (tests only)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--config", default=None, help="YAML of flags (keys: a flag's long name without --)")
    args, _ = p.parse_known_args(argv)
    if args.config:  # as 0.5.23: the file's values first, the command line's win
        import yaml

        # ``utils/server_args_config_parser.py`` turns each key into ``--<key>`` verbatim, so a key
        # spelled as a dest (``api_key``) is an unknown argument there: refused here too
        config = yaml.safe_load(Path(args.config).read_text()) or {}
        known = {"api-key", "admin-api-key"}
        unknown = [f"--{key}" for key in config if key not in known]
        if unknown:
            p.error(f"unrecognized arguments: {' '.join(unknown)}")
        for key, value in config.items():
            dest = key.replace("-", "_")
            if getattr(args, dest) is None:
                setattr(args, dest, str(value))
    return args


async def serve(args: argparse.Namespace) -> None:
    import torch

    from dora_megatron.ports import free_port
    from dora_megatron.rollout.engine.server import build_app

    torch.set_num_threads(int(os.environ.get("SGLANG_STANDIN_THREADS", "1")))  # test machines are small

    host = os.environ.get("FAKE_NODE_ADDR", args.host)  # fake multi-node jobs: each 'node' is a loopback address
    inner = web.AppRunner(build_app(args.model_path, max_running=args.max_running_requests,
                                    weight_version=str(args.weight_version)))
    await inner.setup()
    inner_port = free_port("127.0.0.1")
    await web.TCPSite(inner, "127.0.0.1", inner_port).start()
    try:
        from tests.sglang_wheel import load

        schemas = load()
    except Exception:  # noqa: BLE001 - validation is an extra; say why it is off
        log.warning("SGLang wheel schemas unavailable; request bodies are not validated", exc_info=True)
        schemas = None
    async with ClientSession(timeout=ClientTimeout(total=None)) as http:
        algo = (args.speculative_algorithm or "").upper()
        draft_path = args.speculative_draft_model_path or args.model_path
        draft = hashlib.sha256(draft_path.encode()).hexdigest() if algo in ("EAGLE", "EAGLE3", "NEXTN") else None
        standin = StandIn(f"http://127.0.0.1:{inner_port}", args.load_format, http, schemas=schemas, draft=draft)
        missing = {p for p in os.environ.get("SGLANG_STANDIN_WITHOUT", "").split(",") if p}
        outer = web.AppRunner(without_routes(standin.app(args.api_key, args.admin_api_key), missing))
        await outer.setup()
        await web.TCPSite(outer, host, args.port).start()
        print(f"sglang stand-in (0.5.23 protocol) listening on http://{host}:{args.port}; "
              f"wheel schemas: {'on' if schemas else 'off'}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await outer.cleanup()
    await inner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(serve(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
