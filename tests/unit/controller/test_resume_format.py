"""A checkpoint or journal written by an older dora (one that named a sample's tokens and
log-probs ``output_ids`` / ``logprobs``, now ``response_ids`` / ``rollout_logprobs``, the training
sample's names; a ``controller.json`` of another layout) stops a resume with an error naming the
file and what is old, never a ``KeyError`` traceback; the same files as written today resume."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.controller.journal import JOURNAL, read_journal
from dora_megatron.controller.main import Endpoints, build_controller, drive
from dora_megatron.data import tokenizer as tok

from tests.helpers.runtime import ck_dir, make

ROOT = Path(__file__).resolve().parents[3]
# the orchestrator of tests.helpers.runtime.make, so that build_controller restores its checkpoint
MAKE_ORCHESTRATOR = ["orchestrator.mode=dora", "orchestrator.tbs=4", "orchestrator.rbs=8", "orchestrator.group_size=2",
                     "orchestrator.max_staleness=2", "orchestrator.cap_before_rebalance=6",
                     "orchestrator.cap_after_rebalance=4", "rollout.num_instances=3"]


def _older(entry: dict) -> dict:
    """``entry`` as a dora before the rename wrote it."""
    out = dict(entry)
    out["output_ids"], out["logprobs"] = out.pop("response_ids"), out.pop("rollout_logprobs")
    return out


def _checkpointed_run(tmp_path: Path) -> tuple[Path, dict]:
    rt, _, _ = make(mode="dora", steps=2, tmp_path=tmp_path)
    asyncio.run(drive(rt))
    ck = ck_dir(tmp_path, 2)
    return ck, json.loads((ck / "controller.json").read_text())


def _build(tmp_path: Path, ck: Path):
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    tok.save_tokenizer(model_dir)
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", [*MAKE_ORCHESTRATOR, "controller.journal=false"])
    endpoints = Endpoints({f"e{i}": f"http://127.0.0.1:{i + 1}" for i in range(3)}, "http://127.0.0.1:9")
    return build_controller(cfg, endpoints, run_dir=tmp_path, model_dir=model_dir, make_engine=str, checkpoint=ck)


def test_an_older_checkpoint_is_refused_naming_its_file_the_entry_and_the_key(tmp_path):
    ck, state = _checkpointed_run(tmp_path)
    finished = state["samples"]
    assert finished and all({"response_ids", "rollout_logprobs"} <= set(s) for s in finished)
    ctl = _build(tmp_path, ck)  # today's names: resumed, each finished sample's tokens back in its record
    for s in finished:
        rec = ctl.runtime.store.samples[s["sample_id"]]
        assert rec.finished and rec.response_ids.tolist() == s["response_ids"] and len(s["response_ids"]) > 0
        assert rec.rollout_logprobs.tolist() == pytest.approx(s["rollout_logprobs"])
    ctl.close()
    state["samples"] = [_older(s) for s in finished]
    (ck / "controller.json").write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        _build(tmp_path, ck)
    text = str(err.value)
    assert text.startswith(f"{ck / 'controller.json'}: samples[0] (sample {finished[0]['sample_id']}): "
                           "no 'response_ids' but 'output_ids'"), text
    assert "older dora" in text and not isinstance(err.value.__cause__, KeyError)


def test_an_older_controller_json_layout_is_refused_naming_its_file(tmp_path):
    """A controller.json that still lists the consumed groups (now consumed.jsonl's) is an older
    dora's: ``--resume`` names the file and what is old, and builds nothing."""
    ck, state = _checkpointed_run(tmp_path)
    state["consumed"] = ["g0", "g1"]
    (ck / "controller.json").write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        _build(tmp_path, ck)
    assert str(err.value) == (f"{ck / 'controller.json'}: the consumed groups (now consumed.jsonl's): written by an "
                              "older dora; this version cannot resume from it (start a new run)")
    del state["consumed"]
    state["orchestrator"]["format"] = 1  # an orchestrator snapshot of another format: refused by the same file name
    (ck / "controller.json").write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        _build(tmp_path, ck)
    assert str(err.value) == (f"{ck / 'controller.json'}: orchestrator snapshot format 1 is not supported "
                              "(this version reads format 3 only)")


def test_an_entry_without_the_tokens_is_refused_without_blaming_an_older_dora(tmp_path):
    ck, state = _checkpointed_run(tmp_path)
    del state["samples"][1]["rollout_logprobs"]
    (ck / "controller.json").write_text(json.dumps(state))
    with pytest.raises(ValueError) as err:
        _build(tmp_path, ck)
    assert str(err.value) == (f"{ck / 'controller.json'}: samples[1] (sample {state['samples'][1]['sample_id']}): "
                              "no 'rollout_logprobs'")


def test_an_older_journal_is_refused_naming_its_file_line_and_key(tmp_path):
    lines = [{"t": "checkpoint", "version": 2},
             {"t": "dispatch", "group_id": "g5", "version": 2, "prompt_index": 5, "sample_ids": ["g5.0"]},
             {"t": "sample", "sample_id": "g5.0", "group_id": "g5", "version": 2, "prompt_index": 5, "versions": [2],
              "reward": 1.0, "replayed": False, "response_ids": [4, 5], "rollout_logprobs": [-0.5, -0.25]}]
    (tmp_path / JOURNAL).write_text("".join(json.dumps(x) + "\n" for x in lines))
    back = read_journal(tmp_path, 2)["g5.0"]  # today's names: read back
    assert back.response_ids == (4, 5) and back.rollout_logprobs == (-0.5, -0.25)
    (tmp_path / JOURNAL).write_text("".join(json.dumps(x) + "\n" for x in [*lines[:2], _older(lines[2])]))
    with pytest.raises(ValueError, match=r"^" + str(tmp_path / JOURNAL).replace(".", r"\.")
                       + r":3 \(sample g5\.0\): no 'response_ids' but 'output_ids': written by an older dora"):
        read_journal(tmp_path, 2)
