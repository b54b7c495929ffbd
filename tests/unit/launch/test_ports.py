"""Ports for servers started later come from below the ephemeral range, where outgoing
connections never take them (a trainer once lost its port to one in CI)."""

from __future__ import annotations

import random
import socket

from dora_megatron import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = ports.ephemeral_range()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    assert all(ports._LOWEST <= p < lo for p in got), (got, lo)
    for p in got:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))


def _three_free_ports() -> int:
    """The first of three consecutive ports below the ephemeral range that bind now: the tests run
    beside servers on random ports of that range, and a port a test closed a moment ago may still
    be in TIME_WAIT, so no fixed port is sure to be free."""
    lo, _ = ports.ephemeral_range()
    candidates = range(ports._LOWEST, lo - 3)
    for base in random.sample(candidates, min(200, len(candidates))):
        try:
            for p in range(base, base + 3):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no three consecutive free ports below the ephemeral range")


def test_a_taken_port_is_skipped(monkeypatch):
    base = _three_free_ports()
    monkeypatch.setattr(ports, "_LOWEST", base)
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (base + 3, 60999))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        got = ports.free_ports(2)
    assert sorted(got) == [base, base + 2]  # the listening port skipped, the pool's others taken


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports._LOWEST, 60999))
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p >= ports._LOWEST for p in got)
