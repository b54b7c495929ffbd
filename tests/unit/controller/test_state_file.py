"""The checkpoint's controller part is cut in one loop turn and written a chunk per loop turn
(``controller/state_file.py``): the text is exactly ``json.dumps`` of the cut, the manifest
matches it, the loop keeps running while it is written, and the run's last one is complete when
the run returns."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from dora_megatron.controller.checkpoint_manifest import verify
from dora_megatron.controller.main import drive
from dora_megatron.controller.state_file import json_chunks, write_state

from tests.helpers.runtime import ck_dir, make


def test_chunks_are_the_text_of_json_dumps():
    value = {"format": 1, "samples": [{"sample_id": f"g{i}.0", "ids": list(range(i % 7)), "r": i / 3, "x": None}
                                      for i in range(1000)],
             "by_version": {1: 3, 2: [True, False]}, "nested": {"a": [[1, 2]] * 300, "e": [], "s": "q\"\n\u00e9"},
             "short": [1, 2]}
    chunks = list(json_chunks(value, slice_items=7, chunk_chars=100))
    assert len(chunks) > 10
    assert "".join(chunks) == json.dumps(value)


def test_write_state_yields_between_chunks_and_renames_last(tmp_path):
    state = {"samples": [{"i": i, "ids": list(range(50))} for i in range(20000)]}
    calls = []
    gen = write_state(tmp_path, state, {}, lambda: calls.append((tmp_path / "controller.json").exists()))
    steps = 0
    for _ in gen:
        steps += 1
        assert not (tmp_path / "controller.json").exists() and not calls
    assert steps > 1 and calls == [True]
    assert json.loads((tmp_path / "controller.json").read_text()) == state
    assert verify(tmp_path) == []


def test_a_checkpoint_is_cut_in_the_turn_and_written_by_a_thread_while_the_loop_runs(tmp_path, monkeypatch):
    import threading

    import dora_megatron.controller.state_file as state_file

    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    ck = ck_dir(tmp_path, 2)
    gate, writers = threading.Event(), []
    real_manifest = state_file.write_manifest

    def held_manifest(*args):  # the writer thread waits here until the loop has moved on
        writers.append(threading.get_ident())
        assert gate.wait(10)
        return real_manifest(*args)

    monkeypatch.setattr(state_file, "write_manifest", held_manifest)

    async def main():
        ck.mkdir(parents=True)
        snap = rt.orch.snapshot()
        seen = []
        rt.controller_state.on_checkpoint = seen.append
        rt.write_controller_state(2, snap)
        # ... the launcher's retention hears of it in the turn of the cut: it reads the live versions
        # the checkpoint holds (later the orchestrator has moved on and a needed snapshot would go)
        assert seen == [2]
        want = json.loads("".join(json_chunks(rt.controller_state.state_dict(2, snap))))
        ticks = 0
        while not writers:  # the loop keeps turning while the thread writes
            ticks += 1
            await asyncio.sleep(0.001)
        assert not (ck / "controller.json").exists()  # held before its manifest: not complete yet
        gate.set()
        await asyncio.wait_for(asyncio.gather(*rt.tasks.running), timeout=30)
        return want, threading.get_ident()

    want, loop_thread = asyncio.run(main())
    assert writers and writers[0] != loop_thread
    got = json.loads((ck / "controller.json").read_text())
    got.pop("wall_s"), want.pop("wall_s")
    assert got == want and verify(ck) == []


def test_a_cut_holds_the_samples_arrays_and_the_file_their_lists():
    """The cut (one loop turn) takes a finished sample's arrays as they are, nothing per token;
    the written text has them as JSON lists and the routed experts as SGLang's base64 of int32."""
    import base64
    from array import array

    import numpy as np

    ids, lps = array("i", range(70_000)), array("f", [-0.5, -1.25] * 35_000)
    routed = (np.arange(1000) % 100 - 1).astype(np.int8)
    state = {"samples": [{"sample_id": "g0.0", "response_ids": ids, "rollout_logprobs": lps, "routed_experts": routed},
                         {"sample_id": "g0.1", "response_ids": array("i"), "rollout_logprobs": array("f")}]}
    text = "".join(json_chunks(state, chunk_chars=1000))
    got = json.loads(text)
    assert got["samples"][0]["response_ids"] == list(range(70_000))
    assert got["samples"][0]["rollout_logprobs"] == [-0.5, -1.25] * 35_000
    assert base64.b64decode(got["samples"][0]["routed_experts"]) == routed.astype("<i4").tobytes()
    assert got["samples"][1] == {"sample_id": "g0.1", "response_ids": [], "rollout_logprobs": []}


def test_the_last_checkpoint_is_complete_when_the_run_returns(tmp_path):
    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    seen = []
    rt.controller_state.on_checkpoint = seen.append
    summary = asyncio.run(drive(rt))
    assert summary["steps"] == 4 and seen == [2, 4]
    for v in (2, 4):
        assert (ck_dir(tmp_path, v) / "controller.json").is_file() and verify(ck_dir(tmp_path, v)) == []


def test_the_last_checkpoint_is_written_while_the_loop_runs_and_its_failure_fails_the_run(tmp_path, monkeypatch):
    """The run's last controller.json (at reasoning lengths millions of tokens) is not waited for on
    the loop: the run's end waits for it in a thread, and a write that fails ends the run with it."""
    import threading
    import time

    import pytest

    import dora_megatron.controller.state_file as state_file

    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    ticks, seen = [0], {}
    real_manifest = state_file.write_manifest

    def failing_manifest(path, entries):
        if Path(path) != ck_dir(tmp_path, 4):
            return real_manifest(path, entries)
        # the last one: the loop turns on while it is written (a loop waiting for it never would)
        start, deadline = ticks[0], time.monotonic() + 10
        while ticks[0] < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["loop_turned"], seen["thread"] = ticks[0] >= start + 3, threading.get_ident()
        raise OSError("disk full")

    monkeypatch.setattr(state_file, "write_manifest", failing_manifest)

    async def main():
        async def tick():
            while True:
                ticks[0] += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.get_running_loop().create_task(tick())
        try:
            await asyncio.wait_for(drive(rt), timeout=60)
        finally:
            ticker.cancel()

    with pytest.raises(OSError, match="disk full"):
        asyncio.run(main())
    assert seen["loop_turned"] and seen["thread"] != threading.get_ident()
    assert (ck_dir(tmp_path, 2) / "controller.json").is_file() and not (ck_dir(tmp_path, 4) / "controller.json").exists()
