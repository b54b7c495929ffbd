"""Which samples go into which micro-batch, and at what padded length (pure Python, no torch).

WHY: every micro-batch is a dense ``[rows, seq_len]`` block, so the compute spent on a step is
``sum(rows * seq_len)`` over its micro-batches whatever the samples' lengths. With long-tailed
lengths and one length for the whole step (the fixed plan: ``micro_batch_size`` rows, all padded
to the step's longest sample) most of that is padding. The token-budget plan sorts the samples by
length and gives each micro-batch as many rows as fit in ``max_tokens`` at the padded length of its
longest row, so short samples share a micro-batch with short samples (the cuts between micro-batches
weigh padding against the number of micro-batches: :func:`token_budget_plan`).

Constraints the plan keeps (they are what Megatron's schedule and the MoE dispatcher need):

* every data-parallel rank gets the same number of micro-batches, and the k-th micro-batch has the
  same ``[rows, seq_len]`` on every DP rank (the expert-parallel group spans DP ranks and the
  allgather dispatcher gathers equal-sized blocks); filler rows (index ``-1``) fill the last one;
* lengths are rounded up to ``seq_multiple`` (the TP size when sequence parallelism splits the
  sequence over TP ranks);
* with pipeline parallelism micro-batches of different shapes need Megatron's
  ``variable_seq_lengths`` (the worker sets it), which is a worker concern, not the plan's.

Grouping never changes the loss: the loss is a sum over tokens (or samples) divided by a count
summed over all micro-batches and ranks (``calculate_per_token_loss``, :mod:`dora_megatron.algo.losses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MicroBatchSlot:
    """One micro-batch of this rank: sample indices per row (``-1`` = filler) and the padded length."""

    rows: tuple[int, ...]
    seq_len: int


@dataclass(frozen=True)
class StepPlan:
    """This rank's micro-batches and the padding of the whole step (all DP ranks together)."""

    micro_batches: tuple[MicroBatchSlot, ...]
    #: Fraction of the token positions the step computes (all ranks, filler rows included) that
    #: belong to no sample.
    padding_fraction: float


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_step(lengths: Sequence[int], *, dp: int, dp_rank: int, micro_batch_size: int, max_tokens: int,
              seq_multiple: int = 1, max_seq_len: int | None = None, micro_batch_multiple: int = 1) -> StepPlan:
    """The fixed plan (``max_tokens == 0``) or the token-budget plan for samples of ``lengths``.

    ``micro_batch_multiple``: the number of micro-batches is rounded up to a multiple of it with
    micro-batches of filler rows (Megatron's interleaved schedule runs micro-batches in groups of
    ``pp``). Raises ValueError for an empty batch or a sample longer than ``max_seq_len``."""
    if not lengths:
        raise ValueError("the trainer got an empty batch")
    longest = max(lengths)
    if max_seq_len is not None and longest > max_seq_len:
        raise ValueError(f"sample of {longest} tokens exceeds trainer.max_seq_len={max_seq_len}")
    if max_tokens:
        plan = token_budget_plan(lengths, dp=dp, dp_rank=dp_rank, max_tokens=max_tokens, seq_multiple=seq_multiple)
    else:
        plan = fixed_plan(lengths, dp=dp, dp_rank=dp_rank, micro_batch_size=micro_batch_size,
                          seq_multiple=seq_multiple)
    return pad_micro_batch_count(plan, lengths, dp, micro_batch_multiple)


def pad_micro_batch_count(plan: StepPlan, lengths: Sequence[int], dp: int, multiple: int) -> StepPlan:
    """``plan`` with filler micro-batches (the shape of its last one) up to a multiple of ``multiple``."""
    mbs = plan.micro_batches
    extra = -len(mbs) % multiple
    if not extra:
        return plan
    last = mbs[-1]
    filler = MicroBatchSlot((-1,) * len(last.rows), last.seq_len)
    mbs = mbs + (filler,) * extra
    computed = dp * sum(len(m.rows) * m.seq_len for m in mbs)
    return StepPlan(mbs, 1.0 - sum(lengths) / computed)


def fixed_plan(lengths: Sequence[int], *, dp: int, dp_rank: int, micro_batch_size: int,
               seq_multiple: int = 1) -> StepPlan:
    """Batch order, a contiguous share per DP rank, ``micro_batch_size`` rows per micro-batch, every
    micro-batch padded to the step's longest sample (the trainer's behaviour before token budgets)."""
    n = len(lengths)
    seq_len = round_up(max(lengths), seq_multiple)
    per = math.ceil(n / dp)
    count = max(1, math.ceil(per / micro_batch_size))
    mine = list(range(dp_rank * per, min(n, (dp_rank + 1) * per)))
    slots = mine + [-1] * (count * micro_batch_size - len(mine))
    mbs = tuple(MicroBatchSlot(tuple(slots[m * micro_batch_size:(m + 1) * micro_batch_size]), seq_len)
                for m in range(count))
    computed = dp * count * micro_batch_size * seq_len
    return StepPlan(mbs, 1.0 - sum(lengths) / computed)


#: What one more micro-batch costs, in padded-token equivalents, when the budget plan weighs fewer
#: micro-batches against less padding (per-micro-batch work that does not scale with tokens:
#: kernel launches, the MoE dispatcher's collectives, Python). Measured on the CPU workload with
#: tools/trainer_packing_bench.py (docs/results/trainer_cpu.md).
MICRO_BATCH_OVERHEAD_TOKENS = 64


def token_budget_plan(lengths: Sequence[int], *, dp: int, dp_rank: int, max_tokens: int,
                      seq_multiple: int = 1, overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS) -> StepPlan:
    """Samples sorted longest first and cut into rounds of ``dp`` micro-batches (one per rank) of
    ``rows`` samples each, padded to the round's longest (``rows * length <= max_tokens``; a sample
    longer than the budget runs alone); a round's samples are dealt round-robin so the ranks' token
    counts stay close. The cuts minimise ``padded tokens + overhead_tokens * micro-batches`` (exact,
    by dynamic programming over the sorted order): filling every micro-batch to the budget would pad
    short samples to a long one's length."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    padded = [round_up(lengths[i], seq_multiple) for i in order]
    # best[p] = (cost, rows of the round starting at sorted position p) for the samples order[p:]
    best: dict[int, tuple[int, int]] = {n: (0, 0)}
    for p in sorted(range(0, n, dp), reverse=True):
        most = max(1, max_tokens // padded[p])
        choice: tuple[int, int] | None = None
        for rows in range(min(most, math.ceil((n - p) / dp)), 0, -1):  # largest first: ties keep fewer rounds
            nxt = min(n, p + rows * dp)
            cost = dp * rows * padded[p] + overhead_tokens * dp + best[nxt][0]
            if choice is None or cost < choice[0]:
                choice = (cost, rows)
        best[p] = choice
    mine: list[MicroBatchSlot] = []
    computed = 0
    p = 0
    while p < n:
        rows = best[p][1]
        take = order[p:p + rows * dp]
        rows = math.ceil(len(take) / dp)
        share = take[dp_rank::dp]
        mine.append(MicroBatchSlot(tuple(share) + (-1,) * (rows - len(share)), padded[p]))
        computed += dp * rows * padded[p]
        p += len(take)
    return StepPlan(tuple(mine), 1.0 - sum(lengths) / computed)
