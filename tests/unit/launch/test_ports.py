"""Ports for servers started later come from below the ephemeral range, where outgoing
connections never take them (a trainer once lost its port to one in CI)."""

from __future__ import annotations

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


def test_a_taken_port_is_skipped(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports._LOWEST + 3, 60999))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports._LOWEST + 1))
        taken.listen()
        got = ports.free_ports(2)
    assert ports._LOWEST + 1 not in got and all(p < ports._LOWEST + 3 for p in got)


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports._LOWEST, 60999))
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p >= ports._LOWEST for p in got)
