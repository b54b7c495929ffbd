"""The one port allocator: a job's services pick from the job range (``launch.port_range``), anything
else from a range disjoint from it, both below the ephemeral range where outgoing connections never
take a port; a port someone holds is reported with its holder."""

from __future__ import annotations

import os
import random
import socket

import pytest

from dora_megatron import ports
from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from tests.helpers.servers import hold_port


def _listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen()
    return s


def test_other_ports_and_job_ports_come_from_disjoint_ranges_below_the_ephemeral_range():
    eph_lo, _ = ports.ephemeral_range()
    lo, hi = ports.job_port_range()
    assert hi < eph_lo and ports.OTHER_RANGE[1] < lo  # a helper's pick can never be a job's
    other = ports.free_ports(20)
    assert len(set(other)) == 20 and all(ports.OTHER_RANGE[0] <= p <= ports.OTHER_RANGE[1] for p in other)
    job = ports.pick_ports(20, "127.0.0.1", (lo, hi))
    assert len(set(job)) == 20 and all(lo <= p <= hi for p in job)
    for p in job:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))


def _free_window(n: int) -> int:
    """The first of ``n`` consecutive ports of the job range that bind now (no fixed port is sure to
    be free beside the other tests' servers)."""
    lo, hi = ports.job_port_range()
    for base in random.sample(range(lo, hi - n), 300):
        if all(ports._binds("0.0.0.0", p) for p in range(base, base + n)):
            return base
    raise AssertionError(f"no {n} consecutive free ports in the job range")


def test_a_pick_inside_a_configured_range_skips_a_held_port_and_says_when_the_range_is_full():
    base = _free_window(3)
    with _listen(base + 1):
        got = ports.pick_ports(2, "0.0.0.0", (base, base + 2))
        assert sorted(got) == [base, base + 2]  # the held port skipped, only the range's others
        with pytest.raises(ports.NoFreePort, match=rf"only 2 of the 3 port\(s\).*\[{base}, {base + 2}\]"):
            ports.pick_ports(3, "0.0.0.0", (base, base + 2))
    # ``avoid``: a restart never takes the port that just failed, even when it binds again
    assert ports.pick_ports(1, "0.0.0.0", (base, base + 1), avoid=[base]) == [base + 1]


def test_a_held_port_is_reported_with_its_node_and_the_holders_pid_and_command():
    base = _free_window(1)
    with hold_port(base) as holder:
        with pytest.raises(ports.PortInUse) as err:  # the collision happened: binding it fails
            ports.check_bindable("n3", "0.0.0.0", base, "engine0")
        msg = str(err.value)
        assert f"engine0 cannot bind port {base} on node n3" in msg
        assert f"pid {holder.pid} (" in msg and "time.sleep(120)" in msg and f"127.0.0.1:{base}" in msg
        found = ports.port_holders(base)
        assert [h.pid for h in found] == [holder.pid]
    ports.check_bindable("n3", "0.0.0.0", base, "engine0")  # free again: no error


def test_the_holder_is_found_in_the_proc_tables_of_this_process(tmp_path):
    """Our own listening socket: /proc/net/tcp gives its inode, /proc/<pid>/fd the owner."""
    base = _free_window(1)
    with _listen(base):
        found = ports._proc_holders(base, ports.Path("/proc"))
    assert [(h.pid, h.address) for h in found] == [(os.getpid(), f"127.0.0.1:{base}")]
    assert ports._proc_holders(base, ports.Path("/proc")) == []  # closed: nobody listens


def test_launch_port_range_is_checked_and_used_by_the_job_range(tmp_path):
    cfg = load_config(None, ["launch.port_range=[41000,41009]"])
    assert ports.job_port_range(cfg.launch.port_range) == (41000, 41009)
    for bad in ("[41009,41000]", "[0,10]", "[41000]"):
        with pytest.raises(ConfigError, match="launch.port_range"):
            load_config(None, [f"launch.port_range={bad}"])
