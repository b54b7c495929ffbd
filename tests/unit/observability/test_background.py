"""The off-loop writer of the run's pictures and dumps, and its two users: the rollout dumps and
the overview redrawn at each checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from dora_megatron.controller.main import drive
from dora_megatron.data.codec import CharCodec
from dora_megatron.observability.background import BackgroundWriter
from dora_megatron.observability.overview import CheckpointOverviews
from dora_megatron.observability.rollout_dump import RolloutDumper
from tests.helpers.runtime import make

PNG = b"\x89PNG\r\n\x1a\n"


def test_jobs_run_in_order_on_another_thread_and_close_flushes_every_one(tmp_path):
    gate = threading.Event()
    ran: list[tuple[int, str]] = []

    def job(k: int) -> None:
        gate.wait(5)
        ran.append((k, threading.current_thread().name))

    w = BackgroundWriter(name="test-writer")
    for k in range(5):
        assert w.submit(f"job {k}", job, k)
    assert ran == []  # submit does not wait for the work
    gate.set()
    w.close()
    assert [k for k, _ in ran] == list(range(5)) and {n for _, n in ran} == {"test-writer"}
    assert w.done == 5 and w.failed == 0
    assert not w.submit("late", job, 9) and w.dropped == 1  # after close: refused, not lost silently
    w.close()  # idempotent


def test_a_failing_job_is_logged_not_raised_and_the_next_ones_still_run(caplog):
    out = []

    def boom():
        raise ValueError("cannot draw this")

    with caplog.at_level(logging.ERROR), BackgroundWriter() as w:
        w.submit("overview at checkpoint v4", boom)
        w.submit("next", out.append, 1)
    assert out == [1] and w.failed == 1 and w.done == 1
    assert "overview at checkpoint v4 failed" in caplog.text and "cannot draw this" in caplog.text


def test_a_full_queue_drops_with_a_warning_instead_of_blocking(caplog):
    gate = threading.Event()
    w = BackgroundWriter(pending=1)
    w.submit("held", gate.wait, 5)
    deadline = time.monotonic() + 5
    while not w._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker took the first job: the queue is empty, the job runs
    assert w.submit("waits", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert not w.submit("one too many", lambda: None)
    assert w.dropped == 1 and "one too many dropped" in caplog.text
    gate.set()
    w.close()
    assert w.done == 2


def test_the_runtime_dumps_through_the_writer_and_close_leaves_every_step_written(tmp_path):
    w = BackgroundWriter()
    threads = []
    dumper = RolloutDumper(tmp_path, 2, CharCodec(), writer=w)
    write = dumper._write

    def spy(*args):
        threads.append(threading.current_thread().name)
        return write(*args)

    dumper._write = spy
    rt, _, trainer = make(mode="dora", steps=3, tbs=4, G=2, rollout_dump=dumper)
    asyncio.run(drive(rt))
    w.close()
    files = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert files == [f"step_{k:06d}.jsonl" for k in range(3)] and dumper.files == 3
    assert set(threads) == {w.name}  # never on the event loop's thread
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["step"] == 2 for r in rows)


def _scalars(step: int) -> dict:
    return {"reward/mean": 0.1 * step, "perf/step_time_s": 1.0, "perf/wait_time_s": 0.3, "staleness/mean": 1.0,
            "staleness/max": 2, "versions/live": 2}


def test_checkpoint_overviews_draw_the_rows_so_far_off_the_caller(tmp_path):
    with BackgroundWriter() as w:
        ov = CheckpointOverviews(tmp_path / "overview.png", w, max_staleness=2, title="dora")
        assert not ov.checkpoint(0)  # no step yet: nothing to draw
        for k in range(4):
            ov.step(k, _scalars(k), staleness=[0, 1, 2])
        assert ov.checkpoint(4)
        ov.step(4, _scalars(4), staleness=[1])  # later steps do not change the queued drawing's rows
    assert (tmp_path / "overview.png").read_bytes()[:8] == PNG
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary renamed over it
    assert w.done == 1 and ov.histogram == {0: 4, 1: 5, 2: 4}


def test_a_resumed_run_seeds_its_checkpoint_overviews_with_the_steps_before_the_checkpoint(tmp_path):
    from dora_megatron.controller.outputs import earlier_steps

    (tmp_path / "steps.jsonl").write_text("".join(json.dumps({"step": k, **_scalars(k)}) + "\n" for k in range(2)))
    (tmp_path / "consumed.jsonl").write_text(
        json.dumps({"step": 0, "groups": ["a", "b"], "versions": [0, 0]}) + "\n"
        + json.dumps({"step": 1, "groups": ["c", "d"], "versions": [0, 1]}) + "\n"
        + json.dumps({"step": 2, "groups": ["e"], "versions": [1]}) + "\n"  # re-done after the resume: not counted
        + '{"step": 3, "gro')  # torn by the crash
    seed = earlier_steps(tmp_path)
    assert [r["step"] for r in seed["rows"]] == [0, 1] and seed["staleness"] == {0: 3, 1: 1}
    ov = CheckpointOverviews(tmp_path / "overview.png", None, **seed)
    ov.step(2, _scalars(2), staleness=[1])
    assert [r["step"] for r in ov.rows] == [0, 1, 2] and ov.histogram == {0: 3, 1: 2}
