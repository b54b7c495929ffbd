"""What a migration by abort + resubmit costs on an engine without KV migration (SGLang): the
statistics of ``tools/bench_reprefill.py``, pure functions of its timings.

WHY per repetition first: each repetition times, side by side, one request's decode on its original
instance, the resubmission of its prompt + partial output to a cold instance (the re-prefill), and
the same resubmission to the original instance, whose radix cache still holds those tokens. On a
shared machine the load drifts between repetitions by more than these differ, so the ratios and
differences are taken within a repetition and only then summarised (median and range).

WHY a least-squares line for the estimate: a move's cost against not moving (the resubmission's
first token against one decode step of the original, :attr:`RepTiming.cost_s`) has a fixed part (a
request's round trip, a forward pass) and a part per re-prefilled token; a run's re-prefill
counters give moves and tokens, so its re-prefill time is ``moves x fixed + tokens x per token``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Spread:
    """Median and range of a few repetitions."""

    median: float
    lo: float
    hi: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def spread(values: Sequence[float]) -> Spread:
    """Median, min and max of ``values`` (a clear error when there are none)."""
    if not values:
        raise ValueError("spread of no values: every repetition of this length failed or none ran")
    return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class RepTiming:
    """One repetition at one partial-output length, seconds of wall time of dora's client.

    ``prompt_tokens`` + ``partial_tokens`` is what the resubmission re-prefills;
    ``decode_s``: the original instance decoding the ``partial_tokens`` (a ``/generate`` of
    ``partial_tokens + 1`` new tokens minus one of 1, both on the cached prompt);
    ``reprefill_s``: the resubmission (prompt + partial, one new token) on a cold instance;
    ``warm_s``: the same resubmission on the original instance (its radix cache hits)."""

    prompt_tokens: int
    partial_tokens: int
    decode_s: float
    reprefill_s: float
    warm_s: float

    def __post_init__(self) -> None:
        if self.partial_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens and partial_tokens must be >= 1, got {self.prompt_tokens}, "
                             f"{self.partial_tokens}")
        for name in ("decode_s", "reprefill_s", "warm_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def tokens(self) -> int:
        """Tokens the resubmission re-prefills (what dora counts as ``reprefill_tokens``)."""
        return self.prompt_tokens + self.partial_tokens

    @property
    def extra_s(self) -> float:
        """The re-prefill's cost over a resubmission whose tokens are cached (may be < 0 in noise)."""
        return self.reprefill_s - self.warm_s

    @property
    def decode_step_s(self) -> float:
        return self.decode_s / self.partial_tokens

    @property
    def cost_s(self) -> float:
        """What the move costs against not moving: the resubmission's first token against the one
        decode step the original instance would have spent on it."""
        return self.reprefill_s - self.decode_step_s


def length_row(reps: Sequence[RepTiming]) -> dict[str, Any]:
    """The summary of one partial-output length: each timing, and the within-repetition ratios
    (re-prefill over the decode of the same tokens, re-prefill over the warm resubmission, the
    re-prefill in decode steps of the original instance), the cost against not moving
    (:attr:`RepTiming.cost_s`) and the extra seconds per re-prefilled token over a cached
    resubmission."""
    if not reps:
        raise ValueError("length_row of no repetitions")
    lengths = {(r.prompt_tokens, r.partial_tokens) for r in reps}
    if len(lengths) != 1:
        raise ValueError(f"length_row mixes (prompt, partial) lengths {sorted(lengths)}")
    (prompt, partial), = lengths
    return {
        "prompt_tokens": prompt,
        "partial_tokens": partial,
        "reprefill_tokens": prompt + partial,
        "decode_s": spread([r.decode_s for r in reps]),
        "reprefill_s": spread([r.reprefill_s for r in reps]),
        "warm_s": spread([r.warm_s for r in reps]),
        "cost_s": spread([r.cost_s for r in reps]),
        "reprefill_over_decode": spread([r.reprefill_s / r.decode_s for r in reps]),
        "reprefill_over_warm": spread([r.reprefill_s / r.warm_s for r in reps]),
        "reprefill_in_decode_steps": spread([r.reprefill_s / r.decode_step_s for r in reps]),
        "extra_s_per_token": spread([r.extra_s / r.tokens for r in reps]),
    }


@dataclass(frozen=True)
class Line:
    """``seconds = fixed_s + per_token_s x tokens``."""

    fixed_s: float
    per_token_s: float


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares line through ``(tokens, seconds)`` points (at least two distinct token counts)."""
    xs = [float(x) for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line needs at least two distinct token counts, got {sorted(set(xs))}")
    mx = statistics.fmean(xs)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return Line(my - slope * mx, slope)


def run_estimate(line: Line, moves: int, tokens: int, wall_s: float, instances: int) -> dict[str, float]:
    """A run's re-prefill time from its counters (``moves`` resubmissions re-prefilling ``tokens``
    in all) on ``line``, and its share of the run's wall time and of its instance time
    (``instances`` x wall: the instances re-prefill in parallel). An estimate: the line is measured
    one request at a time, while a run's re-prefills share forward passes with other requests."""
    if moves < 0 or tokens < 0 or wall_s <= 0 or instances < 1:
        raise ValueError(f"run_estimate: moves {moves} and tokens {tokens} must be >= 0, wall_s {wall_s} > 0, "
                         f"instances {instances} >= 1")
    seconds = moves * line.fixed_s + tokens * line.per_token_s
    return {"reprefill_s": seconds, "share_of_wall": seconds / wall_s,
            "share_of_instance_time": seconds / (wall_s * instances)}
