"""The launcher's stop signals (real signals to this process): the first asks the armed target for
a stop at the next step boundary, the second (or any while nothing is armed) ends at once; the
SLURM node's variant writes FAILED only when it ends at once, and holds on non-controller nodes."""

from __future__ import annotations

import os
import signal

import pytest

from dora_megatron.launch.stop import STOP_SIGNALS, Stopped, StopSignals, exit_status


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)  # the handler runs in this (main) thread before the next statement


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_the_first_signal_asks_for_a_stop_and_the_second_exits_at_once(sig):
    asked, immediate = [], []
    with StopSignals(on_immediate=immediate.append) as stops:
        stops.arm(lambda name: asked.append(name) or True)
        _send(sig)
        assert asked == [signal.Signals(sig).name] and not immediate
        with pytest.raises(Stopped) as err:
            _send(sig)
    assert err.value.signame == signal.Signals(sig).name and immediate == [err.value.signame]
    assert asked == [signal.Signals(sig).name]  # the second one did not ask again
    assert signal.getsignal(sig) is not stops.handle  # the previous handler is back


def test_a_signal_while_nothing_is_armed_exits_at_once():
    with StopSignals() as stops:
        with pytest.raises(Stopped):
            _send(signal.SIGTERM)
        stops.count = 0
        stops.arm(lambda name: True)
        stops.disarm()  # the runtime ended: the final outputs are not waited for
        with pytest.raises(Stopped):
            _send(signal.SIGINT)


def test_exit_status_is_the_shells():
    assert (exit_status("SIGINT"), exit_status("SIGTERM"), exit_status("SIGUSR1")) == (130, 143, 138)


def test_slurm_nodes_write_failed_only_when_they_end_at_once(tmp_path):
    from dora_megatron.launch.slurm_run import FAILED, _EndSignals, read_marker

    with _EndSignals(tmp_path, "7", "n2", hold=True):  # a node without the controller: keeps its processes
        _send(signal.SIGUSR1)
        assert read_marker(tmp_path) is None
        with pytest.raises(Stopped):
            _send(signal.SIGTERM)
    m = read_marker(tmp_path)
    assert m.kind == FAILED and "SIGTERM on n2" in m.reason and m.job_id == "7"
    with _EndSignals(tmp_path / "x", "8", "n1", mark=False):  # a joining node: no marker
        (tmp_path / "x").mkdir()
        with pytest.raises(Stopped):
            _send(signal.SIGUSR1)
    assert read_marker(tmp_path / "x") is None


def test_the_controllers_node_marks_a_stop_at_once_and_the_final_marker_replaces_it(tmp_path):
    """SLURM's SIGKILL may come before the stop's checkpoint: the first signal already leaves a
    (provisional) FAILED; the other nodes keep serving while it says stopping (bounded), and the
    final FAILED, naming the checkpoint, replaces it."""
    import time

    from dora_megatron.launch.slurm_run import FAILED, _EndSignals, _serve_until_end, read_marker, write_marker

    asked = []
    with _EndSignals(tmp_path, "7", "n1") as stops:
        stops.arm(lambda name: asked.append(name) or True)
        _send(signal.SIGTERM)
    m = read_marker(tmp_path)
    assert asked == ["SIGTERM"] and m.kind == FAILED and m.stopping and "terminated by SIGTERM on n1" in m.reason

    class Engines:
        checks = 0

        def check(self):
            Engines.checks += 1

    t0 = time.monotonic()
    assert _serve_until_end(tmp_path, Engines(), "7", poll_s=0.01, stopping_bound_s=0.3) == 1
    assert time.monotonic() - t0 >= 0.3 and Engines.checks > 3  # served on while the controller checkpointed
    assert write_marker(tmp_path, FAILED, "terminated by SIGTERM on n1: checkpoint v000004 written", "7")
    m = read_marker(tmp_path)
    assert not m.stopping and "v000004" in m.reason
    assert not write_marker(tmp_path, FAILED, "later", "7")  # a final marker is kept
