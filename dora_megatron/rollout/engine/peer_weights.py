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

from dora_megatron.comm.protocol import ProtocolError, _bool, _float, _obj, _short, _str, _version

VERSION_HEADER = "X-Dora-Weight-Version"
CHECKSUM_HEADER = "X-Dora-Weights-Checksum"


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
CHUNK = 8 << 20  # aiohttp sends one huge body far slower (~60 MB/s) than a stream of 8 MiB writes


def capture(s: Any) -> tuple[dict[str, torch.Tensor], str, str]:
    """On the engine thread: the live weights (no copy) with their version and checksum.

    Not copied: if a weight update lands while they are being sent, the receiver's checksum
    check fails and it keeps its old weights (a copy would cost one model's memory and time)."""
    return dict(s.model.hf_state_dict()), s.weight_version, s.weights_checksum()


class Blob:
    """A safetensors-format byte stream of ``state``, produced without an extra full copy."""

    def __init__(self, state: dict[str, torch.Tensor], version: str, checksum: str) -> None:
        import json

        self.tensors = [(n, state[n].detach().to("cpu").contiguous()) for n in sorted(state)]
        header: dict[str, Any] = {"__metadata__": {"weight_version": str(version), "checksum": checksum}}
        offset = 0
        for name, t in self.tensors:
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"{name}: dtype {t.dtype} cannot be sent")
            n = t.numel() * t.element_size()
            header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = len(raw).to_bytes(8, "little") + raw
        self.nbytes = len(self.head) + offset

    def chunks(self):
        yield self.head
        for _, t in self.tensors:
            if t.numel() == 0:
                continue
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(view), CHUNK):
                yield view[i:i + CHUNK]


def headers(version: str, checksum: str) -> dict[str, str]:
    return {VERSION_HEADER: str(version), CHECKSUM_HEADER: checksum}


async def stream(request: Any, state: dict[str, torch.Tensor], version: str, checksum: str,
                 extra_headers: dict[str, str] | None = None) -> Any:
    """Answer ``request`` with the safetensors stream of ``state`` (Content-Length set);
    ``extra_headers``: e.g. the proof that this instance belongs to the puller's job."""
    from aiohttp import web

    blob = Blob(state, version, checksum)
    resp = web.StreamResponse(headers={**headers(version, checksum), **(extra_headers or {})})
    resp.content_type = "application/octet-stream"
    resp.content_length = blob.nbytes
    await resp.prepare(request)
    for chunk in blob.chunks():
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def parse(buf: bytearray) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors byte buffer, as views into ``buf`` (ValueError if malformed)."""
    import json

    if len(buf) < 8:
        raise ValueError("shorter than the safetensors header")
    hlen = int.from_bytes(buf[:8], "little")
    if hlen > len(buf) - 8:
        raise ValueError(f"header length {hlen} exceeds the {len(buf)} bytes received")
    header = json.loads(bytes(buf[8:8 + hlen]))
    base, size = 8 + hlen, len(buf) - 8 - hlen
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_NAMES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{name}: unknown dtype {info.get('dtype')!r}")
        shape = [int(x) for x in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= size or end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{name}: data offsets {begin}..{end} do not fit shape {shape} in {size} data bytes")
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + begin) if numel else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape)
    return out


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


def _decode(buf: bytearray) -> tuple[dict[str, torch.Tensor], str]:
    from dora_megatron.comm.checksum import weights_checksum

    state = parse(buf)
    return state, weights_checksum(state)


async def fetch(req: PeerRequest, secret: str | None = None) -> Fetched:
    """Download and verify the peer's weights; ProtocolError (400) on any problem. With the job's
    ``secret``: the call carries it, and weights come only from a peer that proves it holds the same
    one (an HMAC of a fresh nonce, :func:`~dora_megatron.comm.auth.proof`); 403 otherwise, before a
    byte of the body is read."""
    import aiohttp

    from dora_megatron.comm import auth

    nonce = auth.new_nonce()
    sent = {**auth.auth_headers(secret), auth.NONCE_HEADER: nonce} if secret else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=req.timeout_s), headers=sent) as sess:
            async with sess.get(req.url + "/dora/weights") as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise ProtocolError(f"peer {req.url} answered HTTP {resp.status} to /dora/weights: {text}")
                if secret and not auth.proven(secret, nonce, resp.headers.get(auth.PROOF_HEADER)):
                    raise ProtocolError(f"peer weight pulls only from the job's own instances: {req.url} did not "
                                        "prove it holds the job's secret; old weights kept", 403)
                version = resp.headers.get(VERSION_HEADER)
                announced = resp.headers.get(CHECKSUM_HEADER)
                expected_len = resp.content_length
                if expected_len is None:
                    raise ProtocolError(f"peer {req.url} sent no Content-Length")
                buf = bytearray(expected_len)  # filled in place: no second copy of the model
                got = 0
                async for chunk in resp.content.iter_chunked(CHUNK):
                    n = len(chunk)
                    if got + n > expected_len:
                        raise ProtocolError(f"peer {req.url} sent more than its Content-Length")
                    buf[got:got + n] = chunk
                    got += n
    except ProtocolError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ProtocolError(f"cannot fetch weights from peer {req.url}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if version is None or announced is None:
        raise ProtocolError(f"peer {req.url} did not send {VERSION_HEADER}/{CHECKSUM_HEADER} (not a dora engine?)")
    if got != expected_len:
        raise ProtocolError(f"peer {req.url}: truncated weights ({got} of {expected_len} bytes), old weights kept")
    if req.weight_version is not None and req.weight_version != version:
        raise ProtocolError(f"peer {req.url} holds weight_version {version}, not the requested {req.weight_version}; "
                            "old weights kept")
    try:
        state, checksum = await asyncio.get_running_loop().run_in_executor(None, _decode, buf)
    except Exception as exc:  # noqa: BLE001 - corrupt blob
        raise ProtocolError(f"peer {req.url}: unreadable weights blob ({str(exc)[:200]}), old weights kept") from None
    if checksum != announced:
        raise ProtocolError(f"peer {req.url}: weights checksum {checksum[:16]}... != announced {announced[:16]}..., "
                            "old weights kept")
    if req.checksum is not None and checksum != req.checksum:
        raise ProtocolError(f"peer {req.url}: weights checksum {checksum[:16]}... != expected {req.checksum[:16]}..., "
                            "old weights kept")
    return Fetched(state, version, checksum, got)
