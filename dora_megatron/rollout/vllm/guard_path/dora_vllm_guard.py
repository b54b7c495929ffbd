"""An ASGI middleware vLLM loads (``--middleware dora_vllm_guard.require_job_secret``) so that every
route of a job's vLLM server asks for the job's secret, not only the ones vLLM guards itself.

WHY: vLLM 0.32's ``--api-key`` (``VLLM_API_KEY``) guards only paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``); the dev-mode
routes dora drives (``/collective_rpc``, ``/pause``, ``/abort_requests``, ``/weight_checker`` ...)
would stay open to anyone, and ``/collective_rpc`` reloads weights from any path. This file runs in
vLLM's own venv, where dora_megatron is not installed: it lives alone in its directory (put on
``PYTHONPATH``) and needs only the standard library and Starlette, which vLLM brings. Same rule as
``dora_megatron.comm.auth``: 401 without a bearer credential, 403 with a wrong one, ``/health`` open.
"""

from __future__ import annotations

import hmac
import os

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def refusal(authorization: str | None, key: str) -> int | None:
    """None when ``authorization`` is ``Bearer <key>``, else 401 (none) or 403 (wrong)."""
    scheme, _, offered = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not offered:
        return 401
    return None if hmac.compare_digest(offered.strip().encode(), key.encode()) else 403


async def require_job_secret(request, call_next):
    """vLLM's ``--middleware`` hook (an ``http`` middleware function)."""
    key = os.environ.get(KEY_ENV, "")
    if key and request.method != "OPTIONS" and request.url.path not in OPEN_PATHS:
        status = refusal(request.headers.get("Authorization"), key)
        if status is not None:
            from starlette.responses import JSONResponse

            return JSONResponse({"error": "unauthorized" if status == 401 else "forbidden"}, status_code=status)
    return await call_next(request)
