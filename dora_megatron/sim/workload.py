"""Synthetic rollout workload: prompt and response lengths per group.

WHY deterministic per group index: every mode must see the *same* prompts in the same order so
that a throughput ratio compares policies, not luck. Group ``k`` always gets the lengths drawn
from ``Random((seed, k))`` whatever the mode, dispatch order or instance. The only mode-visible
dependency is drift: a group dispatched with version ``v`` has its response lengths scaled by
``(1 + drift_per_step)^v`` (RL on reasoning tasks lengthens responses as training goes on).

Within a group, log-lengths share a per-prompt component (``group_correlation``): hard prompts
produce long answers for all G samples, which is what makes group completion, not sample
completion, the long tail.

A multi-turn workload (``workload.turns``) splits each sample's response into turns with a tool call
between two of them. Turns and tool latencies come from a stream of their own per group
(``Random("turns/<seed>/<k>")``), so the lengths of group ``k`` are those of the single-turn
workload with the same seed: the two workloads differ only in turns and tools.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass

from dora_megatron.config.sim import LengthDistConfig, WorkloadConfig


@dataclass(frozen=True)
class GroupSpec:
    """Lengths of one prompt group (token counts)."""

    index: int
    prompt_tokens: int
    response_tokens: tuple[int, ...]
    #: per sample, the model tokens generated when each turn ends (the last is its response length);
    #: empty for a single-turn workload
    turn_ends: tuple[tuple[int, ...], ...] = ()
    #: per sample, the seconds of each tool call (one fewer than its turns)
    tool_s: tuple[tuple[float, ...], ...] = ()
    tool_result_tokens: int = 0  # context each tool result adds

    @property
    def total_tokens(self) -> int:
        """Tokens the trainer sees: prompts, model tokens and the tools' results."""
        env = sum(len(t) for t in self.tool_s) * self.tool_result_tokens
        return self.prompt_tokens * len(self.response_tokens) + sum(self.response_tokens) + env


def split_turns(response_tokens: int, turns: int) -> tuple[int, ...]:
    """Where each of ``turns`` turns ends in a response of ``response_tokens`` model tokens: as even
    as whole tokens allow, every turn at least one token (fewer turns when the response is shorter)."""
    turns = max(1, min(turns, response_tokens))
    return tuple(response_tokens * (i + 1) // turns for i in range(turns))


class LengthSampler:
    """Draws lengths from a :class:`LengthDistConfig`; ``draw(rng, z)`` takes a shared normal."""

    def __init__(self, cfg: LengthDistConfig) -> None:
        self.cfg = cfg
        self._cum: list[float] = []
        if cfg.kind == "empirical":
            total = 0.0
            for row in cfg.bins:
                total += row[2]
                self._cum.append(total)
        self._components = [LengthSampler(c) for c in cfg.components]
        wsum = sum(cfg.weights) if cfg.weights else 0.0
        self._wcum: list[float] = []
        acc = 0.0
        for w in cfg.weights:
            acc += w / wsum
            self._wcum.append(acc)

    def draw(self, rng: random.Random, shared_z: float, corr: float) -> float:
        cfg = self.cfg
        if cfg.kind == "lognormal":
            z = math.sqrt(corr) * shared_z + math.sqrt(1.0 - corr) * rng.gauss(0.0, 1.0)
            return cfg.median * math.exp(cfg.sigma * z)
        if cfg.kind == "point":
            return cfg.value
        if cfg.kind == "empirical":
            u = rng.random() * self._cum[-1]
            i = min(bisect.bisect_right(self._cum, u), len(self._cum) - 1)
            lo, hi, _ = self.cfg.bins[i]
            return lo + (hi - lo) * rng.random()
        # mixture: the component is chosen per sample
        u = rng.random()
        i = min(bisect.bisect_left(self._wcum, u), len(self._wcum) - 1)
        return self._components[i].draw(rng, shared_z, corr)


class Workload:
    """Deterministic group generator for one simulation."""

    def __init__(self, cfg: WorkloadConfig, group_size: int) -> None:
        self.cfg = cfg
        self.group_size = group_size
        self._prompt = LengthSampler(cfg.prompt)
        self._response = LengthSampler(cfg.response)
        self._turns = LengthSampler(cfg.turns)
        self._tool = LengthSampler(cfg.tool_latency_s)

    def group(self, index: int, version: int = 0) -> GroupSpec:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1_000_003 + index)
        prompt = int(min(cfg.max_prompt_tokens, max(1, round(self._prompt.draw(rng, rng.gauss(0, 1), 0.0)))))
        shared = rng.gauss(0.0, 1.0)
        scale = (1.0 + cfg.drift_per_step) ** version if cfg.drift_per_step else 1.0
        lens = []
        for _ in range(self.group_size):
            raw = self._response.draw(rng, shared, cfg.group_correlation) * scale
            lens.append(int(min(cfg.max_response_tokens, max(cfg.min_response_tokens, round(raw)))))
        if not cfg.multi_turn:
            return GroupSpec(index, prompt, tuple(lens))
        trng = random.Random(f"turns/{cfg.seed}/{index}")
        ends, tools = [], []
        for n in lens:
            t = int(min(cfg.max_turns, max(1, round(self._turns.draw(trng, trng.gauss(0.0, 1.0), 0.0)))))
            ends.append(split_turns(n, t))
            tools.append(tuple(max(0.0, self._tool.draw(trng, trng.gauss(0.0, 1.0), 0.0))
                               for _ in range(len(ends[-1]) - 1)))
        return GroupSpec(index, prompt, tuple(lens), tuple(ends), tuple(tools), cfg.tool_result_tokens)
