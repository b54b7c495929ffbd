"""Peer copy of weights between engine instances (dora extension, not in SGLang).

WHY: DORA keeps several versions live; when the orchestrator moves an instance to a version that
another instance already holds, copying from that peer needs neither the trainer (which has moved
on) nor a snapshot on shared disk. The source serves ``GET /dora/weights``: one safetensors blob of
its current state dict, with its ``weight_version`` and weights checksum in the headers (and in
the blob's metadata). The destination (``POST /dora/update_weights_from_peer``) downloads it,
recomputes the checksum and loads it with the same all-or-nothing validation as the other update
paths; any mismatch answers 400 and leaves the old weights and version in place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from dora_megatron.rollout.protocol import ProtocolError, _bool, _float, _obj, _short, _str, _version

VERSION_HEADER = "X-Dora-Weight-Version"
CHECKSUM_HEADER = "X-Dora-Weights-Checksum"


def capture(s: Any) -> tuple[dict[str, torch.Tensor], str, str]:
    """On the engine thread: a consistent copy of the weights with their version and checksum."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in s.model.hf_state_dict().items()}
    return state, s.weight_version, s.weights_checksum()


def serialize(state: dict[str, torch.Tensor], version: str, checksum: str) -> bytes:
    from safetensors.torch import save

    return save(state, metadata={"weight_version": str(version), "checksum": checksum})


def headers(version: str, checksum: str) -> dict[str, str]:
    return {VERSION_HEADER: str(version), CHECKSUM_HEADER: checksum}


CHUNK = 8 << 20  # aiohttp sends one huge body far slower (~60 MB/s) than a stream of 8 MiB writes


async def stream(request: Any, blob: bytes, version: str, checksum: str) -> Any:
    """Send ``blob`` as the response to ``request`` in chunks (Content-Length set)."""
    from aiohttp import web

    resp = web.StreamResponse(headers=headers(version, checksum))
    resp.content_type = "application/octet-stream"
    resp.content_length = len(blob)
    await resp.prepare(request)
    view = memoryview(blob)
    for i in range(0, len(blob), CHUNK):
        await resp.write(view[i:i + CHUNK])
    await resp.write_eof()
    return resp


@dataclass
class PeerRequest:
    url: str
    weight_version: str | None = None
    checksum: str | None = None
    abort_all_requests: bool = False
    timeout_s: float = 600.0

    @classmethod
    def from_json(cls, body: Any) -> "PeerRequest":
        body = _obj(body, "/dora/update_weights_from_peer")
        url = _str(body, "url", None)
        if not url or not (url.startswith("http://") or url.startswith("https://")):
            raise ProtocolError(f"url must be the peer's base URL (http://host:port), got {_short(url)}")
        timeout = _float(body, "timeout_s", 600.0)
        if timeout <= 0:
            raise ProtocolError("timeout_s must be > 0")
        return cls(url=url.rstrip("/"), weight_version=_version(body, "weight_version"),
                   checksum=_str(body, "checksum", None), abort_all_requests=_bool(body, "abort_all_requests", False),
                   timeout_s=timeout)


@dataclass
class Fetched:
    state: dict[str, torch.Tensor]
    version: str
    checksum: str
    nbytes: int


def _decode(blob: bytes) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors.torch import load

    from dora_megatron.weights.checksum import weights_checksum

    state = load(blob)
    return state, weights_checksum(state)


async def fetch(req: PeerRequest) -> Fetched:
    """Download and verify the peer's weights; ProtocolError (400) on any problem."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=req.timeout_s)) as sess:
            async with sess.get(req.url + "/dora/weights") as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise ProtocolError(f"peer {req.url} answered HTTP {resp.status} to /dora/weights: {text}")
                version = resp.headers.get(VERSION_HEADER)
                announced = resp.headers.get(CHECKSUM_HEADER)
                expected_len = resp.content_length
                buf = bytearray()
                async for chunk in resp.content.iter_chunked(CHUNK):
                    buf += chunk
                blob = bytes(buf)
                del buf
    except ProtocolError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ProtocolError(f"cannot fetch weights from peer {req.url}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if version is None or announced is None:
        raise ProtocolError(f"peer {req.url} did not send {VERSION_HEADER}/{CHECKSUM_HEADER} (not a dora engine?)")
    if expected_len is not None and len(blob) != expected_len:
        raise ProtocolError(f"peer {req.url}: truncated weights ({len(blob)} of {expected_len} bytes), old weights kept")
    if req.weight_version is not None and req.weight_version != version:
        raise ProtocolError(f"peer {req.url} holds weight_version {version}, not the requested {req.weight_version}; "
                            "old weights kept")
    try:
        state, checksum = await asyncio.get_running_loop().run_in_executor(None, _decode, blob)
    except Exception as exc:  # noqa: BLE001 - corrupt blob
        raise ProtocolError(f"peer {req.url}: unreadable weights blob ({str(exc)[:200]}), old weights kept") from None
    if checksum != announced:
        raise ProtocolError(f"peer {req.url}: weights checksum {checksum[:16]}... != announced {announced[:16]}..., "
                            "old weights kept")
    if req.checksum is not None and checksum != req.checksum:
        raise ProtocolError(f"peer {req.url}: weights checksum {checksum[:16]}... != expected {req.checksum[:16]}..., "
                            "old weights kept")
    return Fetched(state, version, checksum, len(blob))
