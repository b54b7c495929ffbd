"""The framing and error encoding between the controller and its engine-client workers
(:mod:`.sharded`, :mod:`.shard_worker`).

WHY batches of pickled tuples over one stream: the point of the workers is that the controller's
event loop handles one message per tick instead of one HTTP round trip per request, so every
message queued during one loop turn goes out as one length-prefixed frame (``u32`` big-endian
length, then ``pickle`` of a list of tuples). Both ends are this package, started by the
controller itself over a private socketpair, so pickle is safe here (never on a network socket).

Exceptions do not pickle reliably (:class:`~.client.EngineError` takes three constructor
arguments, aiohttp's errors reference live objects), so a worker sends each failure as a small
tuple and the controller rebuilds the exception class the runtime decides on: engine errors and
version refusals and unavailable probes as themselves, unreachable engines as :class:`ConnectionError`, timeouts as
:class:`asyncio.TimeoutError`; anything else becomes a :class:`RuntimeError` (which the runtime
does not take for an engine failure, as in process).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

_LEN = struct.Struct(">I")
MAX_FRAME = 1 << 30


class FrameWriter:
    """Queues messages and writes all of one loop turn as one frame (``call_soon``)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._out: list[tuple] = []
        self._scheduled = False
        self.closed = False
        self.frames = 0
        self.messages = 0

    def send(self, msg: tuple) -> None:
        if self.closed:
            raise ConnectionError("the worker connection is closed")
        self._out.append(msg)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._out or self.closed:
            self._out.clear()
            return
        batch, self._out = self._out, []
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        self.frames += 1
        self.messages += len(batch)
        try:
            self.writer.write(_LEN.pack(len(data)) + data)
        except (ConnectionError, RuntimeError):  # the other end is gone: the reader reports it
            self.closed = True

    def close(self) -> None:
        self._flush()
        self.closed = True
        try:
            self.writer.close()
        except RuntimeError:  # the loop is closing
            pass


async def read_frame(reader: asyncio.StreamReader) -> list[tuple]:
    """One frame's messages; :class:`asyncio.IncompleteReadError` at the end of the stream."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return pickle.loads(await reader.readexactly(n))


def encode_error(err: BaseException) -> tuple:
    """``err`` as a picklable tuple (see the module doc)."""
    from dora_megatron.comm.engine_client import EngineError, ExtensionUnsupported, ProbeUnavailable, VersionMismatch

    if isinstance(err, EngineError):
        kind = "version" if isinstance(err, VersionMismatch) else "probe" if isinstance(err, ProbeUnavailable) else "engine"
        return (kind, err.url, err.status, err.message)
    if isinstance(err, ExtensionUnsupported):
        return ("extension", str(err))
    from dora_megatron.comm.limits import local_resource_error

    if local_resource_error(err):  # the worker's own shortage: kept apart, so no instance is failed for it
        return ("local", getattr(err, "url", ""), f"{type(err).__name__}: {err}")
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return ("timeout", str(err) or type(err).__name__)
    if isinstance(err, (OSError, ConnectionError)) or type(err).__module__.split(".")[0] == "aiohttp":
        return ("connection", f"{type(err).__name__}: {err}")
    return ("other", f"{type(err).__name__}: {err}")


def decode_error(code: tuple) -> BaseException:
    from dora_megatron.comm.engine_client import EngineError, ExtensionUnsupported, ProbeUnavailable, VersionMismatch

    kind = code[0]
    if kind in ("engine", "version", "probe"):
        cls = {"version": VersionMismatch, "probe": ProbeUnavailable}.get(kind, EngineError)
        return cls(code[1], int(code[2]), str(code[3]))
    if kind == "extension":
        return ExtensionUnsupported(code[1])
    if kind == "local":
        from dora_megatron.comm.limits import ControllerResourceError

        return ControllerResourceError(code[1], code[2])
    if kind == "timeout":
        return asyncio.TimeoutError(code[1])
    if kind == "connection":
        return ConnectionError(code[1])
    return RuntimeError(f"engine-client worker: {code[1]}")


def slim_response(resp: Any) -> Any:
    """A generate answer without its raw JSON (the parsed fields carry everything the runtime
    reads, except routed experts): half the bytes on the wire."""
    import dataclasses

    raw = getattr(resp, "raw", None)
    if not dataclasses.is_dataclass(resp) or raw is None:
        return resp
    experts = (raw.get("meta_info") or {}).get("routed_experts")
    return dataclasses.replace(resp, raw={"meta_info": {"routed_experts": experts}} if experts is not None else {})
