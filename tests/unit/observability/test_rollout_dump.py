"""Rollout dumps (``observability.dump_rollouts``): which samples of a step are written, what a row
holds, that a file is written whole, and that the runtime dumps the very samples the trainer gets."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.controller.journal import Journal, JournaledSample, read_journal
from dora_megatron.controller.main import Endpoints, build_controller, drive
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.codec import CharCodec
from dora_megatron.data.tasks import parse_running_sum_prompt, running_sum_answer
from dora_megatron.observability.rollout_dump import RolloutDumper, dump_path, select_samples

from tests.helpers.runtime import ck_dir, make

ROOT = Path(__file__).resolve().parents[3]


def _batch(groups: int, per_group: int) -> list[dict]:
    return [{"group_id": f"g{g}", "sample_id": f"g{g}-{i}", "prompt_ids": [tok.BOS_ID, *tok.encode(f"a{g}:")],
             "response_ids": tok.encode(f"a{i}.") + [tok.EOS_ID], "reward": float(i), "version": g,
             "finish_reason": "stop"} for g in range(groups) for i in range(per_group)]


def test_selection_covers_every_group_before_a_second_sample_of_any():
    batch = _batch(3, 2)
    ids = lambda n: [s["sample_id"] for s in select_samples(batch, n)]  # noqa: E731
    assert ids(2) == ["g0-0", "g1-0"]
    assert ids(4) == ["g0-0", "g1-0", "g2-0", "g0-1"]
    assert ids(6) == ids(100) == ["g0-0", "g1-0", "g2-0", "g0-1", "g1-1", "g2-1"]
    assert ids(0) == [] and select_samples([], 3) == []
    # uneven groups: a group with no sample left is passed over
    uneven = [s for s in _batch(2, 3) if s["sample_id"] != "g1-2"]
    assert [s["sample_id"] for s in select_samples(uneven, 5)] == ["g0-0", "g1-0", "g0-1", "g1-1", "g0-2"]


def test_a_step_file_holds_the_rows_with_their_texts_and_is_replaced_whole(tmp_path):
    dumper = RolloutDumper(tmp_path, 2, CharCodec())
    path = dumper.dump(7, _batch(3, 2))
    assert path == tmp_path / "rollouts" / "step_000007.jsonl" == dump_path(tmp_path, 7)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == ["g0-0", "g1-0"]
    first = rows[0]
    assert set(first) == {"step", "sample_id", "group_id", "version", "finish_reason", "reward", "prompt_text",
                          "prompt_ids", "response_text", "response_ids"}
    assert first["step"] == 7 and first["group_id"] == "g0" and first["version"] == 0
    assert first["finish_reason"] == "stop" and first["reward"] == 0.0
    # the prompt as the model was sent it (BOS kept), the response as the reward saw it (EOS dropped)
    assert first["prompt_text"] == tok.decode(first["prompt_ids"], skip_special=False) != tok.decode(first["prompt_ids"])
    assert first["prompt_text"].endswith("a0:") and first["response_text"] == "a0."
    assert first["response_ids"][-1] == tok.EOS_ID
    # a step re-done (after a resume) replaces its file; no temporary is left behind
    dumper.dump(7, _batch(1, 1))
    assert len(path.read_text().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_000007.jsonl"]
    assert dumper.files == 2


def test_a_file_that_cannot_be_written_is_logged_and_the_run_goes_on(tmp_path, caplog):
    (tmp_path / "rollouts").write_text("not a directory")
    dumper = RolloutDumper(tmp_path, 1, CharCodec())
    with caplog.at_level(logging.WARNING):
        assert dumper.dump(0, _batch(1, 1)) is None
    assert dumper.failures == 1 and "could not write" in caplog.text and "step_000000.jsonl" in caplog.text


def test_the_runtime_dumps_the_samples_the_trainer_is_handed(tmp_path):
    rt, _, trainer = make(mode="dora", steps=3, tbs=4, G=2, rollout_dump=RolloutDumper(tmp_path, 3, CharCodec()))
    asyncio.run(drive(rt))
    files = sorted((tmp_path / "rollouts").iterdir())
    assert [p.name for p in files] == [f"step_{k:06d}.jsonl" for k in range(3)]
    for step, (path, batch) in enumerate(zip(files, trainer.batches)):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 3 and len({r["group_id"] for r in rows}) == 3  # three prompts, one sample each
        trained = {(s.group_id, tuple(s.prompt_ids), tuple(s.response_ids), s.reward, s.version)
                   for s in batch}
        for r in rows:
            assert r["step"] == step and r["finish_reason"] == "stop"
            assert (r["group_id"], tuple(r["prompt_ids"]), tuple(r["response_ids"]), r["reward"], r["version"]) in trained
            assert r["sample_id"].startswith(r["group_id"])
            digits = parse_running_sum_prompt(r["prompt_text"])
            assert r["prompt_text"].startswith(tok.decode([tok.BOS_ID], skip_special=False))
            assert r["response_text"] == running_sum_answer(digits) + "."


def test_finish_reason_survives_a_checkpoint_and_the_journal(tmp_path):
    rt, _, _ = make(mode="dora", steps=2, tmp_path=tmp_path)
    asyncio.run(drive(rt))
    state = json.loads((ck_dir(tmp_path, 2) / "controller.json").read_text())
    finished = state["samples"]  # only finished samples have an entry
    assert finished and all(s["finish_reason"] == "stop" for s in finished)
    rt2, _, _ = make(mode="dora", steps=4, tmp_path=tmp_path)
    rt2.controller_state.load_state_dict(state)  # the records only (their rows: tests/unit/controller/test_runtime.py)
    assert all(rt2.store.samples[s["sample_id"]].finish_reason == "stop" for s in finished)
    j = Journal(tmp_path)
    j.start(3)
    j.sample(JournaledSample("s1", "g1", 3, 0, (5, 6), (-0.1, -0.2), 1.0, None, "length"), [3])
    j.sample(JournaledSample("s2", "g1", 3, 0, (7,), (-0.3,), 0.0), [3])
    j.close()
    back = read_journal(tmp_path, 3)
    assert back["s1"].finish_reason == "length" and back["s2"].finish_reason is None


def test_the_config_key_builds_the_dumper_and_a_negative_count_is_refused(tmp_path):
    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir()
    model_dir.mkdir()
    tok.save_tokenizer(model_dir)
    endpoints = Endpoints({"a": "http://127.0.0.1:1"}, "http://127.0.0.1:3")
    for n, built in ((0, False), (5, True)):
        cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", [f"observability.dump_rollouts={n}"])
        rt = build_controller(cfg, endpoints, run_dir=run_dir, model_dir=model_dir, make_engine=str).runtime
        dump = rt.training.rollout_dump  # the trainer step dumps what it hands the trainer
        assert (dump is not None) == built
        if built:
            assert dump.n == 5 and dump.run_dir == run_dir and dump.codec is rt.codec
    with pytest.raises(ConfigError, match=r"observability.dump_rollouts: must be >= 0, got -1"):
        load_config(ROOT / "configs" / "cpu_tiny.yaml", ["observability.dump_rollouts=-1"])
