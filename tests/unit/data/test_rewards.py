"""Reward functions: a verl ``compute_score`` file or module run unchanged in worker processes (sync or
async, a number or a dict with ``score`` and extras), failures as reward 0 with the error (an
exception, a time-out, a worker that dies: the worker is replaced), load problems named at start;
the built-ins by name."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.data.reward_api import RewardInput, ThreadScorer, reward_input
from dora_megatron.data.reward_workers import ProcessScorer
from dora_megatron.data.rewards import RewardLoadError, normalise_result
from dora_megatron.data.sources import make_scorer
from dora_megatron.data.tasks import Prompt

REWARD_FILE = '''
import asyncio, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """What verl hands a reward, echoed back as extras (and misbehaviour on request)."""
    if solution_str == "raise":
        raise KeyError("no such thing")
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "die":
        os._exit(7)
    if solution_str == "text":
        return "not a number"
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth,
            "from_source": float(data_source == "example/arithmetic"), "weight": extra_info["weight"],
            "pid": os.getpid(), "pred": solution_str}

async def acompute_score(data_source, solution_str, ground_truth, extra_info):
    await asyncio.sleep(0.01)
    return 0.25 if solution_str == ground_truth else 0

def slow(data_source, solution_str, ground_truth, extra_info):
    time.sleep(1.0)
    return 1.0

def two_args(solution_str, ground_truth):
    return 1.0
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.fixture(scope="module")
def scorer(reward_file):
    s = ProcessScorer(f"{reward_file}:compute_score", workers=2, timeout_s=2.0)
    yield s
    s.close()


def _item(solution, truth="7", source="example/arithmetic", extra=None):
    return RewardInput(source, solution, truth, extra if extra is not None else {"weight": 0.5})


def test_a_verl_function_gets_the_rows_fields_and_its_dict_becomes_score_and_extras(scorer):
    prompt = Prompt(0, "", "7", "example/arithmetic", {"weight": 0.5})
    got = scorer.score_sync(reward_input(prompt, "7"))
    assert got.error is None and got.score == 1.0
    assert got.extras["acc"] == 1.0 and got.extras["from_source"] == 1.0 and got.extras["weight"] == 0.5
    assert "pred" not in got.extras  # a string is no metric
    assert got.extras["pid"] in scorer.pids and got.extras["pid"] != os.getpid()  # ran in a worker process
    assert scorer.score_sync(_item("8")).score == 0.0


def test_an_exception_is_reward_zero_with_the_error_and_its_traceback(scorer):
    got = scorer.score_sync(_item("raise"))
    assert got.score == 0.0 and got.error == "KeyError: 'no such thing'"
    assert "my_reward.py" in got.traceback and 'raise KeyError("no such thing")' in got.traceback
    assert scorer.score_sync(_item("text")).error.startswith("TypeError: returned a str ('not a number')")


def test_a_hung_call_times_out_and_its_worker_is_replaced(scorer):
    before = set(scorer.pids)
    t0 = time.monotonic()
    got = scorer.score_sync(_item("hang"))
    assert got.score == 0.0 and got.error == "timed out after 2 s (data.reward_timeout_s)"
    assert 2.0 <= time.monotonic() - t0 < 30
    assert len(set(scorer.pids) - before) == 1  # the hung worker is gone, a fresh one took its place
    assert scorer.score_sync(_item("7")).score == 1.0  # and every worker answers again
    assert scorer.score_sync(_item("7")).score == 1.0


def test_a_worker_that_dies_is_replaced(scorer):
    before = set(scorer.pids)
    got = scorer.score_sync(_item("die"))
    assert got.score == 0.0 and "died during the call (exit code 7" in got.error
    assert len(set(scorer.pids) - before) == 1
    assert [scorer.score_sync(_item("7")).score for _ in range(3)] == [1.0] * 3


def test_async_functions_and_module_specs(reward_file):
    a = ProcessScorer(f"{reward_file}:acompute_score", workers=1)
    try:
        assert a.score_sync(_item("7")).score == 0.25 and a.score_sync(_item("1")).score == 0.0
    finally:
        a.close()
    m = ProcessScorer("dora_megatron.data.rewards:math_compute_score", workers=1)
    try:
        assert m.score_sync(_item("so \\boxed{\\frac{1}{2}}", "0.5")).score == 1.0
    finally:
        m.close()


def test_scoring_runs_off_the_event_loop(reward_file):
    """Two 1-second rewards on two workers: the loop keeps ticking meanwhile, and they overlap."""
    s = ProcessScorer(f"{reward_file}:slow", workers=2)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        results = await asyncio.gather(s.score(_item("a")), s.score(_item("b")))
        elapsed = time.monotonic() - t0
        t.cancel()
        return results, elapsed, ticks

    try:
        results, elapsed, ticks = asyncio.run(main())
    finally:
        asyncio.run(s.aclose())
    assert [r.score for r in results] == [1.0, 1.0]
    assert elapsed < 1.9 and ticks >= 10  # both ran at once, and the loop was free throughout


def test_load_problems_are_named_before_any_sample(reward_file, tmp_path):
    with pytest.raises(RewardLoadError, match=r"two_args\(solution_str, ground_truth\) does not accept verl's "
                                              r"compute_score\(data_source, solution_str, ground_truth, extra_info\)"):
        ProcessScorer(f"{reward_file}:two_args", workers=1)
    with pytest.raises(RewardLoadError, match=r"has no function 'nope' \(it has: acompute_score, compute_score, slow, two_args\)"):
        ProcessScorer(f"{reward_file}:nope", workers=1)
    with pytest.raises(RewardLoadError, match="no such file"):
        ProcessScorer(f"{tmp_path / 'none.py'}:compute_score", workers=1)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_package_here\n")
    with pytest.raises(RewardLoadError, match="importing .*broken.py failed: ModuleNotFoundError"):
        ProcessScorer(f"{broken}:compute_score", workers=1)


def test_reward_fn_syntax_is_checked_at_config_load():
    for bad in ("compute_score", "pkg.mod:", "a-b:f", "pkg.mod:my-fn"):
        with pytest.raises(ValueError, match="data.reward_fn"):
            load_config(None, [f"data.reward_fn={bad}"])
    load_config(None, ["data.reward_fn=pkg.mod:f"])
    load_config(None, ["data.reward_fn=path/to/my_reward.py:compute_score"])


def test_normalise_result():
    assert normalise_result(1) == (1.0, {}) and normalise_result(True) == (1.0, {})
    assert normalise_result({"score": -1, "acc": False, "pred": "x", "n": 3}) == (-1.0, {"acc": 0.0, "n": 3.0})
    with pytest.raises(ValueError, match="without 'score'"):
        normalise_result({"acc": 1.0})
    with pytest.raises(ValueError, match="non-finite"):
        normalise_result(float("nan"))
    with pytest.raises(TypeError, match="returned a NoneType"):
        normalise_result(None)


def test_builtins_by_name(reward_file):
    digit, name = make_scorer(load_config(None, []).data)
    assert isinstance(digit, ThreadScorer) and name == "digit_cipher: exact answer"
    assert digit.score_sync(RewardInput("", "a1b4.", "a1b4")).score == 1.0
    math, name = make_scorer(load_config(None, ["data.task=dataset", "data.path=x.parquet", "data.reward_workers=1"]).data)
    try:
        assert isinstance(math, ProcessScorer) and name == "math: math-verify"
        # symbolic equivalence: what math-verify adds over the fallback's number comparison
        assert math.score_sync(RewardInput("", "so \\boxed{2\\sqrt{2}}", "\\sqrt{8}")).score == 1.0
    finally:
        math.close()
    user, name = make_scorer(load_config(None, [f"data.reward_fn={reward_file}:compute_score",
                                                "data.reward_workers=1"]).data)
    try:
        assert name.startswith(f"{reward_file}:compute_score (verl compute_score, 1 worker process(es)")
    finally:
        user.close()
