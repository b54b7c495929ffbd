"""The training reward sees the sample's own dataset row (``data_source``, ``extra_info``, ground
truth) through the one builder the eval rounds and the bench use, and its failures are counted:
per step (``reward/errors``), in ``summary.json`` (``reward_errors``) and in a warning when a whole
step failed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest

from dora_megatron.controller.main import drive
from dora_megatron.controller.outputs import Progress
from dora_megatron.controller.samples import SampleStore
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.codec import CharCodec
from dora_megatron.data.reward_api import RewardInput, RewardResult, ThreadScorer, reward_input
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.orchestrator import Dispatch
from dora_megatron.config.rollout import RolloutConfig
from tests.helpers.runtime import check_run, make

ROLLOUT = RolloutConfig(max_new_tokens=8)


class TaggedRows:
    """The running-sum prompts as dataset rows that carry a ``data_source`` and ``extra_info`` of
    their own, both derived from the row's index (so a reward handed another row's shows it)."""

    def __init__(self) -> None:
        self.task = RunningSumTask(1, 30, 1.2, seed=1)

    def get(self, index: int):
        return dataclasses.replace(self.task.get(index), data_source=f"sums/{index % 3}",
                                   extra_info={"index": index, "split": "train"})


def own_row(rows: TaggedRows, item: RewardInput) -> bool:
    """``item`` carries one row's arguments, all of the same row."""
    index = item.extra_info.get("index")
    return (index is not None and item.data_source == f"sums/{index % 3}"
            and item.ground_truth == rows.get(index).answer)


def recording_scorer(rows: TaggedRows, seen: list[RewardInput], fail_odd_rows: bool = False):
    """A verl-style reward: 1.0 for a right running sum scored with its own row, -1 otherwise; rows
    with an odd index raise when ``fail_odd_rows``."""

    def fn(item: RewardInput, solution_str: str, ground_truth: str) -> float:
        if fail_odd_rows and item.extra_info["index"] % 2:
            raise ValueError(f"checker crashed on row {item.extra_info['index']}")
        return running_sum_reward(solution_str, ground_truth) if own_row(rows, item) else -1.0

    def score(item: RewardInput) -> RewardResult:  # as a scorer's score_sync: called from worker threads
        seen.append(item)
        return ThreadScorer(lambda solution_str, ground_truth: fn(item, solution_str, ground_truth)).score_sync(item)

    return score


def test_the_store_builds_each_reward_input_from_the_samples_own_row():
    """Both places the store scores (off the loop for an answer, on the loop for one that came
    without a reward) and a store restored from its checkpoint entries hand the reward the row of
    the sample's own group, as :func:`reward_input` builds it for the eval set."""
    rows, seen = TaggedRows(), []
    codec = CharCodec()
    store = SampleStore(rows, codec, recording_scorer(rows, seen), ROLLOUT, seed=0, first_prompt=5)
    g5 = store.dispatch(Dispatch("g5", 0, ["g5/0"]))
    g6 = store.dispatch(Dispatch("g6", 0, ["g6/0", "g6/1"]))
    assert (g5.prompt.index, g6.prompt.index) == (5, 6)

    class Answer:
        def __init__(self, text: str, loss_mask=None) -> None:
            self.output_ids, self.output_token_logprobs = tok.encode(text), None
            self.finish_reason, self.loss_mask = {"type": "stop"}, loss_mask
            self.versions_used, self.migrated, self.token_arrays, self.raw = [], False, None, {}

    off_loop = asyncio.run(store.reward_off_loop(store.samples["g6/1"], Answer("12")))
    store.score(store.samples["g6/1"], Answer("12"), "stop", off_loop)
    rec5 = store.samples["g5/0"]
    store.apply(rec5, Answer("34"))
    store.score(rec5, Answer("34"), "stop")  # no reward computed off the loop: the store scores it here
    assert seen == [reward_input(rows.get(6), "12"), reward_input(rows.get(5), "34")]
    assert seen[0].data_source == "sums/0" and dict(seen[1].extra_info) == {"index": 5, "split": "train"}

    # a workflow's trajectory: the reward reads the model's tokens only, not the tool's result
    rec = store.samples["g6/0"]
    ids = tok.encode("7") + tok.encode("[tool]") + tok.encode("9")
    mask = [1] + [0] * len(tok.encode("[tool]")) + [1]
    item = store.reward_input(rec, ids, mask)
    assert item == reward_input(rows.get(6), "79")

    # a resumed run: the restored groups' rows come from the source again, by their prompt index
    groups, samples = store.state_entries()
    restored = SampleStore(rows, codec, recording_scorer(rows, seen), ROLLOUT, seed=0)
    restored.load_entries({"next_prompt": 7, "groups": groups, "samples": samples,
                           "orchestrator": {"groups": [{"group_id": "g5", "sample_ids": ["g5/0"], "version": 0},
                                                       {"group_id": "g6", "sample_ids": ["g6/0", "g6/1"],
                                                        "version": 0}],
                                            "samples": [{"sample_id": sid, "version": 0}
                                                        for sid in ("g5/0", "g6/0", "g6/1")]}})
    assert restored.reward_input(restored.samples["g6/0"], tok.encode("5"), None) == reward_input(rows.get(6), "5")
    assert restored.samples["g5/0"].reward == rec5.reward


@pytest.mark.parametrize("migration", [True, False], ids=["kv-migration", "resubmit"])
def test_every_trained_sample_is_scored_with_its_own_row(migration):
    """A whole run on fake engines (DORA, moves between instances by KV migration or by abort and
    resubmit): every sample the trainer gets was scored with its own row, and right."""
    rows, seen = TaggedRows(), []
    rt, engines, trainer = make(mode="dora", n=3, steps=4, migration=migration)
    rt.store.source = rows
    rt.store.reward_fn = recording_scorer(rows, seen)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 4, 4, 2)  # every trained sample: reward 1.0, i.e. its own row
    assert len(seen) >= 4 * 4 * 2 and all(own_row(rows, item) for item in seen)
    assert summary["reward_errors"] == 0


def test_a_failing_reward_is_counted_per_step_in_the_summary_and_logged_once(tmp_path, caplog):
    """Rows with an odd index make the reward raise: those samples train with reward 0, each step's
    ``reward/errors`` counts its own, ``summary.json`` their sum, and one traceback is logged."""
    rows, seen = TaggedRows(), []
    rt, _, trainer = make(mode="dora", n=2, steps=4, tmp_path=tmp_path)
    rt.store.source = rows
    rt.store.reward_fn = recording_scorer(rows, seen, fail_odd_rows=True)
    with caplog.at_level(logging.WARNING, logger="dora_megatron.controller.samples"):
        summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    failed_per_step = [sum(s.reward == 0.0 for s in batch) for batch in trainer.batches]
    assert all(s.reward in (0.0, 1.0) for batch in trainer.batches for s in batch)
    assert sum(failed_per_step) > 0 and any(s.reward == 1.0 for b in trainer.batches for s in b)
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["reward/errors"] for r in steps] == failed_per_step
    assert summary["reward_errors"] == sum(failed_per_step)
    errors = [r for r in caplog.records if "reward error" in r.getMessage()]
    assert len(errors) == 1 and "ValueError: checker crashed on row" in errors[0].getMessage()
    assert "Traceback" in errors[0].getMessage()


def test_a_step_whose_rewards_all_failed_warns_on_the_progress_line(caplog):
    progress = Progress(total=3, enabled=False)
    with caplog.at_level(logging.INFO, logger="dora_megatron.controller.outputs"):
        progress.update(0, {"reward/mean": 0.5, "reward/errors": 1, "versions/live": 1}, samples=8)
        progress.update(1, {"reward/mean": 0.0, "reward/errors": 8, "versions/live": 1}, samples=8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["step 2: the reward function failed on every sample (8 of 8 scored 0; the first error's "
                        "traceback is logged above)"]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "reward_errors=1" in lines[0] and "reward_errors=8" in lines[1]
