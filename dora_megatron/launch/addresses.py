"""Where a SLURM job's services listen: picked on their node when they start, published in the run directory.

WHY not fixed numbers: two jobs on one node (a shared partition), or any other program holding a
port, would make a fixed port fail after every restart. So the plan names a port by a placeholder
(``{port:engine0}``, ``{port:torchrun}``) and the node that starts the process picks a port free
on that node (:func:`dora_megatron.ports.pick_ports`, inside ``launch.port_range``), writes it into
the command line and publishes ``<run_dir>/addresses/<name>`` (shared filesystem, as
``trainer.ready`` is for local runs); a process on another node that needs the address (a trainer
node's torchrun the rendezvous, the controller every instance) waits for that file. A restarted
instance gets a new port (the old one may be what failed) and publishes again; a record names the
job that wrote it, so a resumed job never reads the addresses of the job it resumes.

A node that sees one of its instances fail publishes the reason in the same record (``failed``),
so the controller reports "cannot bind port P on node N: held by pid X (cmd)" instead of "still
loading" for an instance it cannot see.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dora_megatron.ports import pick_ports

_PLACEHOLDER = re.compile(r"\{port:([A-Za-z0-9_.\-]+)\}")
#: the address a pick is tried on: every local address at once, so a port some process listens on
#: anywhere on the node (an emulated node's neighbour too) is never picked
PICK_HOST = "0.0.0.0"


def placeholder(name: str) -> str:
    """The command-line token for job address ``name``'s port, replaced when the process starts."""
    return "{port:%s}" % name


def placeholders(text: str) -> list[str]:
    """The address names ``text`` refers to, in order of first use."""
    return list(dict.fromkeys(_PLACEHOLDER.findall(text)))


@dataclass(frozen=True)
class Address:
    name: str
    node: str
    port: int
    job: str
    failed: str = ""  # why the service is down (its node saw it fail); empty: serving or starting
    final: bool = False  # no restart follows the failure


def addresses_dir(run_dir: Path) -> Path:
    return run_dir / "addresses"


def publish(run_dir: Path, addr: Address) -> None:
    """Write ``addr`` atomically (readers on other nodes never see half a record)."""
    d = addresses_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{addr.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(addr.__dict__))
    os.replace(tmp, d / addr.name)


def read(run_dir: Path, name: str, job: str) -> Address | None:
    """The record of ``name`` written by job ``job`` (None: none yet, or one of another job)."""
    try:
        d = json.loads((addresses_dir(run_dir) / name).read_text())
        addr = Address(**d)
    except (OSError, ValueError, TypeError):
        return None
    return addr if addr.job == job else None


def wait_for(run_dir: Path, name: str, job: str, timeout_s: float, what: str, poll_s: float = 0.2) -> Address:
    """Wait (bounded) for job ``job``'s record of ``name``; ``what`` names who publishes it in the error."""
    deadline = time.monotonic() + timeout_s
    while True:
        addr = read(run_dir, name, job)
        if addr is not None:
            return addr
        if time.monotonic() > deadline:
            raise TimeoutError(f"no address of {name} in {addresses_dir(run_dir)} after {timeout_s:.0f} s "
                               f"({what} did not publish it)")
        time.sleep(poll_s)


def substitute(text: str, ports: dict[str, int]) -> str:
    return _PLACEHOLDER.sub(lambda m: str(ports[m.group(1)]), text)


@dataclass
class PortPicker:
    """A node's side: picks the ports its processes own and reads the others' (one per job and node)."""

    run_dir: Path
    job: str
    node: str
    port_range: tuple[int, int]
    wait_s: float

    def resolve(self, argv: Sequence[str], owned: Sequence[str], avoid: Sequence[int] = ()) -> tuple[list[str], dict[str, int]]:
        """``argv`` with every placeholder replaced: a name in ``owned`` gets a port free on this node
        now (published at once, none of ``avoid``), any other the port its owner published (waited
        for, bounded by ``wait_s``). Returns the command line and the ports picked here."""
        names = placeholders(" ".join(argv))
        mine = [n for n in names if n in owned]
        picked = dict(zip(mine, pick_ports(len(mine), PICK_HOST, self.port_range, avoid))) if mine else {}
        for name, port in picked.items():
            publish(self.run_dir, Address(name, self.node, port, self.job))
        ports = dict(picked)
        for name in names:
            if name not in ports:
                ports[name] = wait_for(self.run_dir, name, self.job, self.wait_s, f"the node that starts {name}").port
        return [substitute(a, ports) for a in argv], picked

    def failed(self, name: str, port: int, why: str, *, final: bool) -> None:
        """Publish that ``name`` (last on ``port``) failed, and why; a restart publishes its new port."""
        publish(self.run_dir, Address(name, self.node, port, self.job, failed=why, final=final))


def url_resolver(run_dir: Path, job: str) -> Callable[[str], tuple[str | None, Address | None]]:
    """For the controller: ``(url, record)`` of an instance from its template URL
    (``http://n2:{port:engine1}``): the URL with its published port (None: not published yet)."""
    def resolve(template: str) -> tuple[str | None, Address | None]:
        names = placeholders(template)
        if not names:
            return template, None
        addr = read(run_dir, names[0], job)
        return (substitute(template, {names[0]: addr.port}) if addr is not None else None), addr
    return resolve
