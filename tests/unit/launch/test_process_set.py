"""The launcher's children outlive the thread that started them (a restart from a worker thread)."""

from __future__ import annotations

import sys
import threading
import time

from dora_megatron.processes import ProcessSet


def test_a_child_started_from_a_thread_that_then_ends_keeps_running(tmp_path):
    """Linux sends the parent-death signal when the forking *thread* ends: an engine restarted from
    the start-up wait's worker thread was SIGTERMed when that thread went away."""
    with ProcessSet(tmp_path, grace_s=2.0) as procs:
        started = []
        worker = threading.Thread(target=lambda: started.append(
            procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])))
        worker.start()
        worker.join()
        assert not worker.is_alive() and started
        time.sleep(1.0)  # a parent-death signal would have landed by now
        assert started[0].alive(), started[0].failure()
