"""Free TCP ports, the one allocator of the project: a dora job's services and everything else.

Why not ``bind(port 0)``: the kernel picks such a port from the ephemeral range, the range it also
uses for the local side of every outgoing connection. Between choosing a port and the server
binding it (seconds for a trainer that loads a checkpoint first) any outgoing connection on the
machine, the launcher's own health polls included, can take it, and the server dies with
EADDRINUSE (seen in CI). Ports below the ephemeral range are never handed out implicitly, so a
candidate from there that binds now stays free unless another program picks that very port.

Why two disjoint ranges: a job's services (trainer rendezvous, trainer service, weight-update
store, rollout instances) pick from :func:`job_port_range` (``launch.port_range``, default
``[25000, first ephemeral port - 1]``); anything else that wants a port and holds it while jobs run
(the test cluster's slurmd and slurmctld, test servers, a one-off conversion's rendezvous) picks
with :func:`free_port` from ``OTHER_RANGE`` below it. So a port picked for one can never be the
port a job binds a moment later (a slurmd on the engine's 30000 once failed every real-SLURM test).

A port someone holds is reported with its holder (:func:`describe_holders`): the pid and command
line of the listening process where ``/proc`` shows it, else what ``ss -ltnp`` says.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: ports picked by anything that is not a dora job's service (below: well-known/registered ports)
OTHER_RANGE = (20000, 24999)
#: the lowest port of a job's services by default (``launch.port_range`` empty)
JOB_LOWEST = 25000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicitly assigned ports (Linux default 32768-60999)."""
    try:
        lo, hi = map(int, _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def job_port_range(configured: Sequence[int] = ()) -> tuple[int, int]:
    """The ports a job's services pick from: ``launch.port_range`` when set, else
    ``[JOB_LOWEST, first ephemeral port - 1]`` (``[JOB_LOWEST, 32767]`` if the kernel's range starts lower)."""
    if configured:
        lo, hi = configured
        return int(lo), int(hi)
    eph_lo, _ = ephemeral_range()
    return JOB_LOWEST, eph_lo - 1 if eph_lo - 1 > JOB_LOWEST else 32767


class NoFreePort(OSError):
    """No port of the range binds on the host (every one is held)."""


def _binds(host: str, port: int) -> int | None:
    """The port bound (``port`` itself, or the kernel's pick for 0), or None if it is held."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        return s.getsockname()[1]
    except OSError:
        return None
    finally:
        s.close()


def pick_ports(n: int, host: str, port_range: tuple[int, int], avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports of ``port_range`` (inclusive) that bind on ``host`` now, in random order
    (two jobs picking at once rarely try the same one), none of ``avoid`` (e.g. a port that just
    failed). Raises :class:`NoFreePort` naming the range when fewer than ``n`` bind."""
    lo, hi = port_range
    pool = [p for p in range(lo, hi + 1) if p not in set(avoid)]
    random.SystemRandom().shuffle(pool)
    ports: list[int] = []
    for port in pool:
        if len(ports) == n:
            break
        if _binds(host, port) is not None:
            ports.append(port)
    if len(ports) < n:
        raise NoFreePort(f"only {len(ports)} of the {n} port(s) needed are free on {host} in [{lo}, {hi}]")
    return ports


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports on ``host`` for anything that is not a job's service (``OTHER_RANGE``;
    the kernel's choice only if that range is full)."""
    try:
        return pick_ports(n, host, OTHER_RANGE)
    except NoFreePort:
        ports = {_binds(host, 0) for _ in range(4 * n)} - {None}
        if len(ports) < n:
            raise
        return sorted(ports)[:n]


def free_port(host: str = "127.0.0.1") -> int:
    """One port as :func:`free_ports` chooses them."""
    return free_ports(1, host)[0]


# ---------------------------------------------------------------------------------------- holders
@dataclass(frozen=True)
class Holder:
    """A process listening on a port (``pid`` None: the OS names no process, e.g. another user's)."""

    pid: int | None
    command: str
    address: str  # the local address it listens on, e.g. 0.0.0.0:30000

    def __str__(self) -> str:
        who = f"pid {self.pid} ({self.command})" if self.pid is not None else (self.command or "a process not shown")
        return f"{who} listening on {self.address}"


def _hex_addr(text: str) -> str:
    ip, port = text.split(":")
    if len(ip) == 8:
        addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(ip)[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        raw = b"".join(bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, 32, 8))
        addr = "[" + socket.inet_ntop(socket.AF_INET6, raw) + "]"
    return f"{addr}:{int(port, 16)}"


def _listening_inodes(port: int, proc: Path) -> dict[str, str]:
    """socket inode -> local address of every TCP socket listening on ``port`` (state 0A)."""
    out: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out[f[9]] = _hex_addr(f[1])
    return out


def _proc_holders(port: int, proc: Path) -> list[Holder]:
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return []
    found: dict[str, Holder] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m and m.group(1) in inodes and m.group(1) not in found:
                try:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                found[m.group(1)] = Holder(int(d.name), cmd[:200], inodes[m.group(1)])
    return list(found.values()) + [Holder(None, "", a) for i, a in inodes.items() if i not in found]


def _ss_holders(port: int) -> list[Holder]:
    ss = shutil.which("ss")
    if ss is None:
        return []
    try:
        out = subprocess.run([ss, "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    holders = []
    for line in out.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        users = re.findall(r'\("([^"]*)",pid=(\d+)', line)
        holders += [Holder(int(pid), name, f[3]) for name, pid in users] or [Holder(None, "", f[3])]
    return holders


def port_holders(port: int, proc: Path = Path("/proc")) -> list[Holder]:
    """Who listens on TCP ``port`` on this machine: from ``/proc/net/tcp{,6}`` and ``/proc/*/fd``,
    else ``ss -ltnp``. Empty: nobody listens (or the OS shows nothing)."""
    holders = _proc_holders(port, proc)
    if any(h.pid is not None for h in holders):
        return holders
    return _ss_holders(port) or holders


def describe_holders(port: int) -> str:
    """``port``'s listeners in words, for an error message."""
    holders = port_holders(port)
    if not holders:
        return "no listener shown by the OS (a socket being closed, or another network namespace)"
    return "held by " + "; ".join(str(h) for h in holders)


def collision_message(node: str, host: str, port: int, what: str) -> str:
    """The message for a service that cannot bind ``host:port`` on ``node``."""
    return f"{what} cannot bind port {port} on node {node} ({host}:{port}): {describe_holders(port)}"


def check_bindable(node: str, host: str, port: int, what: str) -> None:
    """Raise :class:`PortInUse` naming the holder if ``host:port`` cannot be bound now."""
    if _binds(host, port) is None:
        raise PortInUse(collision_message(node, host, port, what))


class PortInUse(OSError):
    """A fixed port (or a picked one taken since) is held by another process; the message names it."""
