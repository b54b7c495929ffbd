"""One lazily created ``aiohttp.ClientSession`` with its timeout and connection limit, and its close.

WHY one holder: every HTTP client of the controller (SGLang/embedded engines, vLLM servers, the
trainer) and the start-up health checks need the same three things: a session made only once
an event loop runs (a client is often built before one exists), one default timeout that a call
may override, and a close that leaves a session given by the caller open (a session shared by
thousands of clients is closed by whoever made it, once).
"""

from __future__ import annotations

import socket
from functools import partial
from typing import Any, Mapping

import aiohttp
import orjson

from dora_megatron.comm import auth

#: aiohttp's own default: the number of connections one session keeps on the wire at most
DEFAULT_CONNECTION_LIMIT = 100
def encode_json(value: Any) -> bytes:
    """How an owned session encodes ``json=`` bodies: what ``json.dumps`` takes (numpy numbers, float
    subclasses, non-string keys written as strings) as compact UTF-8.

    WHY orjson, not aiohttp's default ``json.dumps``: a resubmitted request carries its prompt and
    its partial answer (up to ``max_new_tokens`` ids), a workflow turn its whole context, encoded on
    the event loop: 30K ids took 2.2 ms with ``json.dumps``, 0.26 ms with orjson."""
    return orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def _json_default(value: Any) -> Any:
    if isinstance(value, float):  # a float subclass json.dumps writes as its value
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


#: aiohttp's own default read buffer of a response (it stops reading a socket at twice this)
AIOHTTP_READ_BUFSIZE = 2**16


def _socket_with_receive_buffer(size: int, addr_info: tuple[Any, ...]) -> socket.socket:
    """A client socket whose receive buffer is ``size`` bytes, set before it connects (the window
    scale is agreed at the handshake); aiohttp's ``socket_factory``."""
    family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return sock


class HttpSession:
    """Owns (or borrows) one session.

    ``timeout``: the default of a call (seconds as ``total``, or a ``ClientTimeout``): an owned
    session's own; a client passes it with each call so that it also holds on a borrowed session.
    ``limit``: connections of an owned session on the wire at most (more requests wait for a slot;
    with ``total=None`` that wait is not timed). aiohttp counts only connections in use against it
    and reuses an idle kept-alive one first, so a session that talks to one host never holds more
    than ``limit`` sockets. ``trace_configs``: aiohttp tracing of an owned session. ``session``: a
    session to borrow instead (its own connection limit applies; :meth:`close` leaves it open).
    ``receive_buffer``: ``SO_RCVBUF`` of an owned session's sockets, and twice what aiohttp buffers of
    an answer not yet read (None: the kernel's autotuning and aiohttp's 64 KiB;
    :attr:`~dora_megatron.comm.limits.ConnectionPlan.receive_buffer`). ``headers``: sent with every call of an owned session; default: the job's credential
    (:func:`~dora_megatron.comm.auth.auth_headers` of the secret in this process's environment), so
    every client of a job is let in by the job's servers without each caller passing it along."""

    def __init__(self, timeout: float | aiohttp.ClientTimeout | None = None, *,
                 limit: int = DEFAULT_CONNECTION_LIMIT, session: aiohttp.ClientSession | None = None,
                 trace_configs: list[aiohttp.TraceConfig] | None = None,
                 headers: Mapping[str, str] | None = None, receive_buffer: int | None = None) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 (0: no limit), got {limit}")
        self.timeout = timeout if isinstance(timeout, aiohttp.ClientTimeout) else aiohttp.ClientTimeout(total=timeout)
        self.limit = limit
        self._session = session
        self._owned = session is None
        self.trace_configs = trace_configs  # of an owned session (e.g. counting waits for a pooled connection)
        self._headers = dict(headers) if headers is not None else None
        self.receive_buffer = receive_buffer  # SO_RCVBUF of an owned session's sockets (None: the kernel's autotuning)

    @property
    def owned(self) -> bool:
        """Whether :meth:`close` closes the session (False: it was given by the caller)."""
        return self._owned

    def session(self) -> aiohttp.ClientSession:
        """The session, made at the first call (which must run on the event loop that uses it)."""
        if self._session is None:
            headers = self._headers if self._headers is not None else auth.auth_headers(auth.secret_from_env())
            factory, read_bufsize = None, AIOHTTP_READ_BUFSIZE
            if self.receive_buffer is not None:
                factory = partial(_socket_with_receive_buffer, self.receive_buffer)
                # WHY: aiohttp reads an answer on until its buffer holds twice this, read or not: an
                # answer waiting for the receive budget then holds 128 KiB here at the default;
                # 8,192 of them were 1.3 GB of copies and loop turns of 0.9 s as they all arrived
                read_bufsize = max(4096, self.receive_buffer // 2)
            connector = aiohttp.TCPConnector(limit=self.limit, socket_factory=factory)
            self._session = aiohttp.ClientSession(timeout=self.timeout, trace_configs=self.trace_configs,
                                                  connector=connector, headers=headers, read_bufsize=read_bufsize,
                                                  json_serialize_bytes=encode_json)
        return self._session

    def call_timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        """The timeout of one call: ``timeout_s`` as its total, or the default (given per call, it
        also holds on a borrowed session, whose own default may be another)."""
        return self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)

    async def close(self) -> None:
        """Close an owned session (a later :meth:`session` makes a new one); a borrowed one stays open."""
        if self._owned and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> "HttpSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
