"""Free TCP ports for servers started a little later: engines, the trainer service, rendezvous stores.

Why not ``bind(port 0)``: the kernel picks such a port from the ephemeral range, the range it also
uses for the local side of every outgoing connection. Between choosing a port and the server
binding it (seconds for a trainer that loads a checkpoint first) any outgoing connection on the
machine, the launcher's own health polls included, can take it, and the server dies with
EADDRINUSE (seen in CI). Ports below the ephemeral range are never handed out implicitly, so a
candidate from there that binds now stays free unless another program picks that very port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # below: the well-known and registered ports of common services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicitly assigned ports (Linux default 32768-60999)."""
    try:
        lo, hi = map(int, _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that bind now, below the ephemeral range when it leaves
    room (else anywhere the kernel picks); each is bound briefly, then released."""
    lo, _ = ephemeral_range()
    pool = list(range(_LOWEST, lo))
    random.SystemRandom().shuffle(pool)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in [*pool, *[0] * n]:  # port 0: the kernel's choice, only if the pool ran out
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise OSError(f"no {n} free TCP ports on {host}")
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port as :func:`free_ports` chooses them."""
    return free_ports(1, host)[0]
