"""The process tree of a job under test: descendants, their sessions, signals to them.

WHY sessions: torchrun starts each rank in a session of its own, and what a rank starts (a
``multiprocessing`` spawn child, its resource tracker) names no run directory on its command
line; a session recorded while the job ran is how a test finds such a process left behind."""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun's ranks may run in their own process groups)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_tree(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's ranks)."""
    return [p for p in process_tree(pid) if p != pid and stat_fields(p)[1:2] == [str(pid)]]


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ... (empty: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def sessions(pids: list[int]) -> set[int]:
    """The session ids of ``pids`` (torchrun starts each rank in a session of its own)."""
    return {int(f[3]) for f in map(stat_fields, pids) if len(f) > 3}


def in_sessions(sids: set[int]) -> list[int]:
    """Live processes of any of the sessions ``sids``."""
    return [int(d.name) for d in Path("/proc").glob("[0-9]*")
            if len(f := stat_fields(int(d.name))) > 3 and int(f[3]) in sids and f[0] != "Z"]
