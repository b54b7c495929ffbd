"""`dora bench` limits: the capacity bookkeeping (pure functions) and the rollout pass on fake engines."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from dora_megatron.data.reward_api import ThreadScorer
from dora_megatron.data.tasks import Prompt
from dora_megatron.launch.capacity import (_rollout_pass, _Sample, bound, record_batches, rollout_requests,
                                           steady_rate, training_rate)

ROOT = Path(__file__).resolve().parents[3]


def test_steady_rate_leaves_out_fill_and_drain():
    # a closed loop of 2: in steady state one completion of 10 tokens per second; the fill (two
    # short requests right after the start) and the drain (the last two, long) would both skew it
    fill = [(0.5, 500), (1.0, 500)]
    steady = [(float(t), 10) for t in range(2, 12)]
    drain = [(30.0, 900), (40.0, 900)]
    assert steady_rate(fill + steady + drain, 2) == pytest.approx(10.0)
    assert steady_rate(list(reversed(fill + steady + drain)), 2) == pytest.approx(10.0)  # order of arrival does not matter
    assert steady_rate(fill + drain, 2) is None  # no steady window at all
    assert steady_rate([(1.0, 5), (1.0, 5), (1.0, 5), (1.0, 5), (1.0, 5)], 1) is None  # zero-length window


def test_training_rate_leaves_out_the_warmup_step():
    assert training_rate([(1000, 100.0), (100, 1.0), (300, 1.0)]) == pytest.approx(200.0)
    assert training_rate([(1000, 100.0)]) is None
    assert training_rate([(1000, 100.0), (100, 1.0)], warmup=0) == pytest.approx(1100 / 101)


def test_recorded_batches_keep_prompt_order_and_whole_batches():
    groups = [[{"g": g, "i": i} for i in range(2)] for g in range(5)]
    batches = record_batches(groups, tbs=2, steps=5)
    assert [[s["g"] for s in b] for b in batches] == [[0, 0, 1, 1], [2, 2, 3, 3]]  # group 4 alone is dropped
    assert len(record_batches(groups, tbs=2, steps=1)) == 1


def test_rollout_requests_cover_the_batches_and_the_window():
    assert rollout_requests(tbs=8, group_size=4, steps=5, concurrency=32) == 160  # the batches need more
    assert rollout_requests(tbs=2, group_size=4, steps=2, concurrency=32) == 128  # four loops of 32
    assert rollout_requests(tbs=1, group_size=3, steps=2, concurrency=2) == 9  # whole groups: 8 -> 9


def test_bound_is_the_slower_stage():
    assert bound({"rollout_tokens_per_s": 300.0, "training_tokens_per_s": 200.0}) == 200.0
    assert bound({"rollout_tokens_per_s": 300.0, "training_tokens_per_s": None}) is None


class _FakeEngine:
    """Answers after a short sleep; records how many requests it holds at once."""

    def __init__(self) -> None:
        self.in_flight = self.peak = self.served = 0

    async def generate(self, ids, sampling, *, rid, return_logprob, version):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        self.served += 1
        return SimpleNamespace(output_ids=[7] * (len(ids) % 3 + 1), output_token_logprobs=None)


def test_rollout_pass_keeps_every_engine_at_its_cap_and_finishes_every_sample():
    cfg = SimpleNamespace(run=SimpleNamespace(seed=1), rollout=SimpleNamespace(
        max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=[]))
    codec = SimpleNamespace(eos_ids=[0], decode=lambda ids: "x" * len(ids))
    engines = {"a": _FakeEngine(), "b": _FakeEngine()}
    samples = [_Sample(g, i, Prompt(g, "p", "xx"), [1] * (g + 1)) for g in range(10) for i in range(4)]
    scorer = ThreadScorer(lambda text, answer: float(text == answer))
    done = asyncio.run(_rollout_pass(cfg, engines, codec, samples, 3, scorer))
    assert len(done) == 40 and all(s.response_ids for s in samples)
    assert [e.peak for e in engines.values()] == [3, 3]  # full concurrency, never above the cap
    assert sum(e.served for e in engines.values()) == 40
    assert sum(tok for _, tok in done) == sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert {s.reward for s in samples if len(s.response_ids) == 2} == {1.0}
    assert all(s.rollout_logprobs == [0.0] * len(s.response_ids) for s in samples)
