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


def test_a_childs_log_shows_what_it_must_not_as_redacted_across_restarts(tmp_path):
    """A program that logs a credential it was given (SGLang 0.5.23 logs its ``api_key`` with its
    arguments): the log holds every line it wrote, the credential in none of them, and a restart
    keeps redacting."""
    secret = "s3cr3t-" + "x" * 40
    script = ("import sys, time\n"
              "for i in range(3): print(f'line {i} api_key={sys.argv[1]!r} and again {sys.argv[1]}', flush=True)\n"
              "print('partial', end='', flush=True); time.sleep(0.2); print(' ' + sys.argv[1], flush=True)\n"
              "time.sleep(60)\n")
    with ProcessSet(tmp_path, grace_s=2.0) as procs:
        child = procs.start("talker", [sys.executable, "-c", script, secret], redact=(secret,))
        deadline = time.monotonic() + 30
        while "partial" not in child.tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.restart("talker")
        deadline = time.monotonic() + 30
        while child.tail().count("line 2") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    log = (tmp_path / "talker.log").read_text()
    assert log.count("line 0 api_key='<redacted>' and again <redacted>") == 2, log
    assert "partial <redacted>" in log and secret not in log
