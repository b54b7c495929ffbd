"""The checkpoint's controller part is cut in one loop turn and written a chunk per loop turn
(``controller/state_file.py``): the text is exactly ``json.dumps`` of the cut, the manifest
matches it, the loop keeps running while it is written, and the run's last one is complete when
the run returns."""

from __future__ import annotations

import asyncio
import json

from dora_megatron.controller.checkpoint_manifest import verify
from dora_megatron.controller.main import drive
from dora_megatron.controller.state_file import json_chunks, write_state

from tests.helpers.runtime import make


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


def test_a_checkpoint_is_cut_in_the_turn_and_written_while_the_loop_runs(tmp_path):
    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    ck = tmp_path / "ck2"

    async def main():
        ck.mkdir()
        snap = rt.orch.snapshot()
        seen = []
        rt.controller_state.on_checkpoint = seen.append
        rt.write_controller_state(2, snap)
        assert not (ck / "controller.json").exists()  # not written in the loop turn of the cut
        # ... but the launcher's retention hears of it in that turn: it reads the live versions
        # the checkpoint holds (later the orchestrator has moved on and a needed snapshot would go)
        assert seen == [2]
        want = json.loads(json.dumps(rt.controller_state.state_dict(2, snap)))
        await asyncio.wait_for(asyncio.gather(*rt.tasks), timeout=30)
        return want

    want = asyncio.run(main())
    got = json.loads((ck / "controller.json").read_text())
    got.pop("wall_s"), want.pop("wall_s")
    assert got == want and verify(ck) == []


def test_the_last_checkpoint_is_complete_when_the_run_returns(tmp_path):
    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    seen = []
    rt.controller_state.on_checkpoint = seen.append
    summary = asyncio.run(drive(rt))
    assert summary["steps"] == 4 and seen == [2, 4]
    for v in (2, 4):
        assert (tmp_path / f"ck{v}" / "controller.json").is_file() and verify(tmp_path / f"ck{v}") == []
