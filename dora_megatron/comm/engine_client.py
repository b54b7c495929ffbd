"""Async HTTP client for one rollout engine speaking SGLang's protocol (plus our extensions).

Why one client for both engines: the controller drives SGLang servers and embedded engines the
same way. Extensions (request export/import, weight checksum, ``dora_version``) are detected
from ``/get_server_info``'s ``dora_extensions`` list (SGLang has none); calling one on an engine
without it raises :class:`ExtensionUnsupported` so the caller can fall back (e.g. migrate by
abort + resubmit of prompt + partial output with re-prefill, as reference A.6 describes).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Awaitable, Mapping, Sequence

import aiohttp
import msgspec

from dora_megatron.comm.answer_reader import AnswerReader
from dora_megatron.comm.generate_codec import decode_generate
from dora_megatron.comm.http_session import HttpSession
from dora_megatron.comm.json_value import JSON, JSONObject, json_object, parse_json, read_answer
from dora_megatron.comm.limits import ConnectionPlan, ConnectionWaits, ControllerResourceError
from dora_megatron.comm.protocol import GenerateRequest, GenerateResponse, SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A non-2xx answer; ``status`` and the server's ``message`` are kept."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url = url
        self.status = status
        self.message = message


class VersionMismatch(EngineError):
    """The engine holds another weight version than the request demands (HTTP 409)."""


class ProbeUnavailable(EngineError):
    """An optional probe (a weights checksum, ``/model_info``, a load or version report) that this
    server does not offer: a build or launch mode without it. WHY its own type: a check that cannot
    run says nothing about the instance, so callers switch the probe off instead of failing the
    instance; only a probe that runs and answers wrong is the instance's fault."""


#: HTTP statuses meaning "this server has no such route or action", not "this instance is broken"
UNAVAILABLE_STATUSES = frozenset({404, 405, 501})
#: words of a 400/422 answer that refuse the action itself (SGLang: ``success: false`` with a message)
_UNAVAILABLE_WORDS = ("unsupported", "not supported", "unknown action", "not implemented", "not enabled",
                      "no such action", "invalid action")


def probe_unavailable(exc: object) -> bool:
    """Whether ``exc`` (an exception, or any result of ``gather(..., return_exceptions=True)``) says
    the probe cannot run on this server (404, 405, 501, or a 400/422 whose message refuses the
    action), as opposed to a probe that ran and failed."""
    if isinstance(exc, ProbeUnavailable):
        return True
    if not isinstance(exc, EngineError) or isinstance(exc, VersionMismatch):
        return False
    if exc.status in UNAVAILABLE_STATUSES:
        return True
    return exc.status in (400, 422) and any(w in str(exc.message).lower() for w in _UNAVAILABLE_WORDS)


def _queued_trace(waits: ConnectionWaits) -> aiohttp.TraceConfig:
    """aiohttp tracing that counts calls waiting for a pooled connection (``limit`` reached) and
    marks the call's ``trace_request_ctx`` while it waits (a timeout then is the pool's)."""
    tc = aiohttp.TraceConfig()

    async def queued(_session: aiohttp.ClientSession, ctx: SimpleNamespace,
                     _params: aiohttp.TraceConnectionQueuedStartParams) -> None:
        waits.add()
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["queued"] = True

    async def dequeued(_session: aiohttp.ClientSession, ctx: SimpleNamespace,
                       _params: aiohttp.TraceConnectionQueuedEndParams) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["queued"] = False

    tc.on_connection_queued_start.append(queued)
    tc.on_connection_queued_end.append(dequeued)
    return tc


#: given to aiohttp with every call: the call's bound is :func:`asyncio.timeout`'s (:func:`_untimed`)
_NO_AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=None)


async def _untimed(bound: asyncio.Timeout, wait: Awaitable[int]) -> int:
    """``await wait`` with ``bound`` stopped meanwhile, then given back the time it had left.

    WHY: a call waits for the answer reader's budget once the engine has answered (the headers
    are in); that wait is this process's back-pressure, as long as the other answers take to
    decode, not the engine's slowness, so it must neither count toward the call's timeout nor
    let a stalled body escape it."""
    deadline = bound.when()
    if deadline is None or bound.expired():  # no bound, or it has fired: the wait ends at once
        return await wait
    loop = asyncio.get_running_loop()
    left = deadline - loop.time()
    bound.reschedule(None)
    try:
        return await wait
    finally:
        bound.reschedule(loop.time() + left)  # none left (the deadline passed as the headers came): at once


class ExtensionUnsupported(RuntimeError):
    """The engine lacks a dora extension (an SGLang server, or an older engine)."""


def _error_message(body: bytes) -> str:
    """The ``message`` of an error answer (SGLang's and ours are ``{"message": ...}``), else its text."""
    try:
        answer = parse_json(body)
    except ValueError:  # not JSON (or not UTF-8): the text says what went wrong
        answer = None
    message = answer.get("message") if isinstance(answer, dict) else None
    return str(message) if message else body.decode(errors="replace")


# The fields read from the answers of the dora extensions (the embedded engine's routes; other
# fields of an answer are ignored).
class _ServerInfo(msgspec.Struct):
    dora_extensions: list[str] | None = None


class _Added(msgspec.Struct):
    added: bool = False


class _ImportedKv(msgspec.Struct):
    tokens: int


class _ReleasedKv(msgspec.Struct):
    released: bool


class _Checksum(msgspec.Struct):
    checksum: str


class EngineClient:
    """Talks to one engine at ``base_url`` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0, *,
                 plan: ConnectionPlan | None = None, waits: ConnectionWaits | None = None,
                 reader: AnswerReader | None = None) -> None:
        """``timeout_s``: each call's bound unless the call names its own (:meth:`_call`: the
        engine's work, not a wait for ``reader``'s budget). ``plan``: this process's connection
        budget (:func:`~dora_megatron.comm.limits.plan_connections`): at most ``plan.generate``
        generates on the wire, more wait for one to end (the wait is not part of the call's
        timeout), and ``plan.generate + plan.control`` sockets in all. ``waits``:
        counts every call that waited for a connection (back-pressure). Without a plan: aiohttp's
        default pool of 100 and no gate. ``reader``: how this process reads big ``/generate``
        answers, shared by its clients (:class:`~dora_megatron.comm.answer_reader.AnswerReader`):
        each is read once its bytes are granted from the process's receive budget and decoded on its
        decoder thread (None: no bound, decoded on the loop's default executor)."""
        self.base_url = base_url.rstrip("/")
        self.waits = waits
        tracing = [_queued_trace(waits)] if waits is not None else None
        if plan is not None:
            self._http = HttpSession(timeout_s, session=session, limit=plan.generate + plan.control,
                                     trace_configs=tracing, receive_buffer=plan.receive_buffer)
            self._generates: asyncio.Semaphore | None = asyncio.Semaphore(plan.generate)
        else:
            self._http = HttpSession(timeout_s, session=session, trace_configs=tracing)
            self._generates = None
        self._extensions: frozenset[str] | None = None
        self.timeout_s = timeout_s  # a call's bound, unless the call names its own
        self.reader = reader  # this process's receive budget and decoder thread (None: neither)

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close this client's own session (a shared one given to the constructor stays open)."""
        await self._http.close()

    async def _call(self, method: str, path: str, json_body: JSONObject | None = None, data: bytes | None = None,
                    timeout_s: float | None = None) -> list[bytes]:
        """One call, bounded by ``timeout_s`` or else the client's ``timeout_s``: a stalled engine raises
        TimeoutError. The bound covers the engine's work (a pooled connection, sending, the headers
        and the body, together), never a wait for the answer reader's budget (:meth:`_call_held`).
        Returns a 2xx answer's body as the list of pieces it arrived in (a big one is joined by the
        caller's worker thread, never copied whole on the loop); a 4xx/5xx answer raises
        :class:`EngineError` (:class:`VersionMismatch` for a 409 about the weight version)."""
        return (await self._call_held(method, path, json_body, data, timeout_s, None))[0]

    async def _call_held(self, method: str, path: str, json_body: JSONObject | None, data: bytes | None,
                         timeout_s: float | None, reader: AnswerReader | None) -> tuple[list[bytes], int]:
        """:meth:`_call`, and with ``reader`` a big body is read only once ``reader`` grants its size
        (:meth:`~dora_megatron.comm.answer_reader.AnswerReader.acquire`); returns the pieces and the
        bytes granted, which the caller gives back to ``reader`` once it has decoded them (0: nothing
        held)."""
        url = self.base_url + path
        queued = {"queued": False}  # set by the tracing while the call waits for a pooled connection
        held = 0
        try:
            # WHY asyncio's timeout and not aiohttp's: aiohttp's ``total`` runs on while the answer
            # waits for ``reader``'s budget (and then fails the first read of the body), so under load
            # a healthy engine's answer was timed out by this process's own wait; this one stops for it
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s) as bound:
                async with self._http.session().request(method, url, json=json_body, data=data,
                                                        timeout=_NO_AIOHTTP_TIMEOUT, trace_request_ctx=queued) as resp:
                    size = resp.content_length or 0
                    if reader is not None and resp.status < 400 and reader.budgeted(size):  # a small one never waits
                        held = await _untimed(bound, reader.acquire(size))
                    # each piece as the socket gave it: a loop turn per piece, none proportional to the body
                    chunks = [chunk async for chunk in resp.content.iter_any()]
        except BaseException as exc:
            if reader is not None:  # nothing of the body is kept
                reader.release(held)
            if isinstance(exc, asyncio.TimeoutError) and queued["queued"]:
                # timed out before any connection was free: the pool's limit, not the engine
                raise ControllerResourceError(url, "no pooled connection became free within the call's timeout") from exc
            raise
        if resp.status >= 400:
            msg = _error_message(b"".join(chunks))
            cls = VersionMismatch if resp.status == 409 and "version" in msg else EngineError
            raise cls(url, resp.status, msg)
        return chunks, held

    async def _bytes(self, method: str, path: str, json_body: JSONObject | None = None,
                     timeout_s: float | None = None) -> bytes:
        """:meth:`_call`'s answer as one body (control answers and exported state: joined once)."""
        chunks = await self._call(method, path, json_body, timeout_s=timeout_s)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _request(self, method: str, path: str, json_body: JSONObject | None = None, data: bytes | None = None,
                       timeout_s: float | None = None) -> JSON:
        """:meth:`_call`'s answer parsed as JSON (an empty body: the empty object)."""
        chunks = await self._call(method, path, json_body, data, timeout_s)
        return parse_json(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    async def _object(self, method: str, path: str, json_body: JSONObject | None = None,
                      data: bytes | None = None) -> JSONObject:
        """:meth:`_request` of a route that answers a JSON object (a ProtocolError otherwise)."""
        return json_object(await self._request(method, path, json_body, data), self.base_url + path)

    # ---- SGLang protocol -----------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, JSON] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        version: int | str | None = None,
        routed_experts: bool = False,
        draft_sources: Sequence[Sequence[int]] = (),
        keep_kv: bool = False,
    ) -> GenerateResponse:
        """POST /generate. ``version`` is sent as ``dora_version`` only if the engine supports it;
        ``routed_experts`` asks for ``meta_info.routed_experts`` over the whole sequence (start 0);
        ``draft_sources`` (token ids of finished group siblings) go as ``dora_draft_sources`` only
        to an engine that offers ``draft_sources``; ``keep_kv`` (the request's KV stays on the engine
        for its trajectory's next turn) goes as ``dora_keep_kv`` only to one that offers ``keep_kv``."""
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_json(sampling_params)
        req = GenerateRequest(list(input_ids), sp, rid, return_logprob, return_routed_experts=routed_experts)
        body = req.to_json()
        if version is not None and await self.supports("dora_version"):
            body["dora_version"] = str(version)
        if draft_sources and await self.supports("draft_sources"):
            body["dora_draft_sources"] = [list(src) for src in draft_sources]
        if keep_kv and await self.supports("keep_kv"):
            body["dora_keep_kv"] = True
        if self._generates is None:
            answer, held = await self._call_held("POST", "/generate", body, None, None, self.reader)
        else:
            if self._generates.locked() and self.waits is not None:
                self.waits.add()  # back-pressure: every generate connection of this instance is in use
            async with self._generates:  # the timeout starts once a connection is ours
                answer, held = await self._call_held("POST", "/generate", body, None, None, self.reader)
        if self.reader is None:
            return await decode_generate(answer)  # a big answer on the loop's default executor
        try:  # a big answer on the reader's thread, the connection free; its bytes held until decoded
            return await self.reader.decode(answer)
        finally:
            self.reader.release(held)

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort by rid prefix (or all); False if nothing matched (already finished)."""
        try:
            await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})
        except EngineError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def pause(self, mode: str = "abort") -> JSONObject:
        return await self._object("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> JSONObject:
        return await self._object("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True once the cache is flushed; False when the engine refused (requests still running).
        The body is not read: SGLang answers plain text ("Cache flushed. ..."), not JSON."""
        try:
            await self._call("POST", "/flush_cache")
        except EngineError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def server_info(self) -> JSONObject:
        return await self._object("GET", "/get_server_info")

    async def weight_version(self) -> str:
        return str((await self._object("GET", "/get_model_info")).get("weight_version"))

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True if ``/health`` answers 200 within ``timeout_s`` (a hung engine gives False, not a wait)."""
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
        except (EngineError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.2) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health(timeout_s=max(0.1, min(5.0, deadline - loop.time()))):
            if loop.time() > deadline:
                raise TimeoutError(f"{self.base_url} not healthy after {timeout_s} s")
            await asyncio.sleep(interval_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> JSONObject:
        body: JSONObject = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._object("POST", "/update_weights_from_disk", body)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "gloo",
    ) -> JSONObject:
        body: JSONObject = {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }
        return await self._object("POST", "/init_weights_update_group", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> JSONObject:
        return await self._object("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group", weight_version: int | str | None = None,
    ) -> JSONObject:
        """POST the metadata; the caller broadcasts the tensors (rank 0) concurrently, in order."""
        body: JSONObject = {
            "names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._object("POST", "/update_weights_from_distributed", body)

    # ---- dora extensions -----------------------------------------------------------------
    async def extensions(self) -> frozenset[str]:
        if self._extensions is None:
            info = read_answer(await self.server_info(), _ServerInfo, self.base_url + "/get_server_info")
            self._extensions = frozenset(info.dora_extensions or ())
        return self._extensions

    async def supports(self, name: str) -> bool:
        return name in await self.extensions()

    async def _require(self, name: str) -> None:
        if not await self.supports(name):
            raise ExtensionUnsupported(f"{self.base_url} does not offer {name}")

    async def add_draft_sources(self, rid: str, sources: Sequence[Sequence[int]]) -> bool:
        """Give running request ``rid`` more speculative drafts (a sibling's finished token ids);
        False when it has already left the engine."""
        await self._require("draft_sources")
        path = "/dora/draft_sources"
        resp = await self._request("POST", path, {"rid": rid, "sources": [list(s) for s in sources]})
        return read_answer(resp, _Added, self.base_url + path).added

    async def export_request(self, rid: str) -> bytes:
        """Take request ``rid`` out of this engine; returns its serialised state (KV included)."""
        await self._require("export_request")
        return await self._bytes("POST", "/dora/export_request", {"rid": rid})

    async def export_kv(self, rid: str) -> bytes:
        """Take the KV kept for ``rid`` (its trajectory's last turn) off this engine, serialised."""
        await self._require("keep_kv")
        return await self._bytes("POST", "/dora/export_kv", {"rid": rid})

    async def import_kv(self, blob: bytes) -> int:
        """Keep the KV ``blob`` (:meth:`export_kv` of another engine) here; returns the tokens it covers."""
        await self._require("keep_kv")
        path = "/dora/import_kv"
        return read_answer(await self._request("POST", path, data=blob), _ImportedKv, self.base_url + path).tokens

    async def release_kv(self, rid: str) -> bool:
        """Free the KV kept for ``rid`` (its trajectory ended); whether there was some."""
        await self._require("keep_kv")
        path = "/dora/release_kv"
        return read_answer(await self._request("POST", path, {"rid": rid}), _ReleasedKv, self.base_url + path).released

    async def import_request(self, blob: bytes) -> GenerateResponse:
        """Continue an exported request here; returns its final generate response."""
        await self._require("import_request")
        return GenerateResponse.from_json(await self._object("POST", "/dora/import_request", data=blob))

    async def weights_checksum(self) -> str:
        await self._require("weights_checksum")
        path = "/dora/weights_checksum"
        return read_answer(await self._request("GET", path), _Checksum, self.base_url + path).checksum

