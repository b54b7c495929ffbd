"""Micro-batch plans: every sample once, the token budget kept, shapes DP-uniform, padding measured."""

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.trainer.packing import plan_step, token_budget_plan

LONG_TAIL = [5, 90, 7, 6, 12, 5, 40, 8, 6, 5, 9, 17, 6, 150, 7, 5]


def plans(lengths, dp, **kw):
    return [plan_step(lengths, dp=dp, dp_rank=r, **kw) for r in range(dp)]


def test_fixed_plan_is_batch_order_padded_to_the_longest():
    (p,) = plans([3, 9, 4], 1, micro_batch_size=2, max_tokens=0)
    assert [(mb.rows, mb.seq_len) for mb in p.micro_batches] == [((0, 1), 9), ((2, -1), 9)]
    assert p.padding_fraction == pytest.approx(1 - 16 / 36)
    r0, r1 = plans([3, 9, 4], 2, micro_batch_size=1, max_tokens=0)
    assert [mb.rows for mb in r0.micro_batches] == [(0,), (1,)] and [mb.rows for mb in r1.micro_batches] == [(2,), (-1,)]


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("budget", [150, 200, 512])
def test_budget_plan_covers_every_sample_once_within_budget_and_uniform_over_ranks(dp, budget):
    ps = plans(LONG_TAIL, dp, micro_batch_size=4, max_tokens=budget)
    rows = [i for p in ps for mb in p.micro_batches for i in mb.rows if i >= 0]
    assert sorted(rows) == list(range(len(LONG_TAIL)))
    shapes = [[(len(mb.rows), mb.seq_len) for mb in p.micro_batches] for p in ps]
    assert all(s == shapes[0] for s in shapes)  # same count and k-th shape on every DP rank
    for p in ps:
        for mb in p.micro_batches:
            assert len(mb.rows) * mb.seq_len <= budget
            assert all(LONG_TAIL[i] <= mb.seq_len for i in mb.rows if i >= 0)
    padded = sum(len(mb.rows) * mb.seq_len for p in ps for mb in p.micro_batches)
    assert ps[0].padding_fraction == pytest.approx(1 - sum(LONG_TAIL) / padded)


def test_budget_plan_pads_far_less_than_the_fixed_plan_on_long_tailed_lengths():
    fixed = plan_step(LONG_TAIL, dp=1, dp_rank=0, micro_batch_size=4, max_tokens=0)
    budget = plan_step(LONG_TAIL, dp=1, dp_rank=0, micro_batch_size=4, max_tokens=4 * 150)
    assert fixed.padding_fraction > 0.8
    assert budget.padding_fraction < fixed.padding_fraction / 3


def test_budget_cuts_are_the_cheapest_of_all_contiguous_cuts():
    """Exhaustive check on a small batch: padded tokens + overhead per micro-batch is minimal."""
    lengths = [30, 3, 9, 4, 17, 5, 6, 4]
    desc = sorted(lengths, reverse=True)
    budget, overhead = 40, 10

    def cheapest(p):  # every way to cut desc[p:] into contiguous micro-batches within the budget
        if p == len(desc):
            return 0
        return min(rows * desc[p] + overhead + cheapest(p + rows)
                   for rows in range(1, len(desc) - p + 1) if rows == 1 or rows * desc[p] <= budget)

    p = token_budget_plan(lengths, dp=1, dp_rank=0, max_tokens=budget, overhead_tokens=overhead)
    cost = sum(len(mb.rows) * mb.seq_len + overhead for mb in p.micro_batches)
    assert cost == cheapest(0)
    free = token_budget_plan(lengths, dp=1, dp_rank=0, max_tokens=budget, overhead_tokens=0)
    assert len(free.micro_batches) > len(p.micro_batches)  # the overhead weight acts


def test_a_sample_longer_than_the_budget_runs_alone_and_lengths_round_to_the_tp_multiple():
    p = plan_step([7, 3, 2], dp=1, dp_rank=0, micro_batch_size=1, max_tokens=6, seq_multiple=4)
    assert [(mb.rows, mb.seq_len) for mb in p.micro_batches] == [((0,), 8), ((1,), 4), ((2,), 4)]


def test_bad_batches_are_refused():
    with pytest.raises(ValueError, match="empty"):
        plan_step([], dp=1, dp_rank=0, micro_batch_size=1, max_tokens=0)
    with pytest.raises(ValueError, match="trainer.max_seq_len=8"):
        plan_step([9], dp=1, dp_rank=0, micro_batch_size=1, max_tokens=64, max_seq_len=8)


def test_budget_below_max_seq_len_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch"):
        load_config(None, ["trainer.max_seq_len=192", "trainer.max_tokens_per_micro_batch=100"])
    assert load_config(None, ["trainer.max_seq_len=192",
                              "trainer.max_tokens_per_micro_batch=192"]).trainer.max_tokens_per_micro_batch == 192


@pytest.mark.parametrize("budget", [0, 64])
def test_interleaved_pipelines_get_a_multiple_of_pp_micro_batches(budget):
    """Megatron's interleaved schedule runs micro-batches in groups of pp: fillers (no sample) make up
    the count, with the last real micro-batch's shape, and count as padding."""
    lengths = [30, 7, 12, 5, 19]
    plain = plan_step(lengths, dp=1, dp_rank=0, micro_batch_size=2, max_tokens=budget)
    plan = plan_step(lengths, dp=1, dp_rank=0, micro_batch_size=2, max_tokens=budget, micro_batch_multiple=4)
    assert len(plan.micro_batches) % 4 == 0 and plan.micro_batches[:len(plain.micro_batches)] == plain.micro_batches
    fillers = plan.micro_batches[len(plain.micro_batches):]
    assert fillers and all(set(m.rows) == {-1} and m.seq_len == plain.micro_batches[-1].seq_len for m in fillers)
    assert plan.padding_fraction > plain.padding_fraction
