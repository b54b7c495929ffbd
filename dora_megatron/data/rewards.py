"""Reward functions by name: a user's verl ``compute_score`` or a built-in, as a :class:`RewardScorer`.

``data.reward_fn`` names one of:

* ``package.module:function`` or ``path/to/file.py:function``: verl's
  ``compute_score(data_source, solution_str, ground_truth, extra_info)``, unchanged (called with
  those four keywords, as verl calls it), sync or ``async``, returning a number or a dict with
  ``score`` and extra numbers. It runs in ``data.reward_workers`` worker processes
  (:class:`~dora_megatron.data.reward_workers.ProcessScorer`), never on the controller's loop.
* ``math``: the final answer against the ground truth with math-verify (in the default install),
  in the same worker processes (math-verify times its parser out with ``signal.alarm``, which only
  a process's main thread may use); the fallback comparison only when math-verify cannot be
  imported, with a warning at start.
* ``digit_cipher`` / ``running_sum``: the exact-answer check of the digit tasks, on a thread (pure
  and fast).

Empty: the task's own reward (``math`` for a prompt dataset). :func:`dora_megatron.data.sources.make_scorer`
builds the scorer of a config.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Mapping

from dora_megatron.data.named import load_named_function

#: The keywords verl passes to ``compute_score``.
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
MATH_SPEC = "dora_megatron.data.rewards:math_compute_score"


class RewardLoadError(ValueError):
    """``data.reward_fn`` cannot be loaded (no such file or module, no such function, wrong signature)."""


def math_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The built-in ``math`` reward in verl's signature: 1.0 when the final answer equals the ground truth."""
    from dora_megatron.data.tasks import math_reward

    return math_reward(solution_str, str(ground_truth))


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``), checked to accept
    verl's four keywords. Raises :class:`RewardLoadError` saying what is wrong."""
    fn = load_named_function(spec, "data.reward_fn", RewardLoadError)
    target, _, name = spec.rpartition(":")
    try:
        inspect.signature(fn).bind(**{k: None for k in VERL_ARGS})
    except TypeError as err:
        raise RewardLoadError(f"data.reward_fn: {target}:{name}{inspect.signature(fn)} does not accept verl's "
                              f"compute_score({', '.join(VERL_ARGS)}) keywords ({err})") from err
    except ValueError:  # a builtin without a signature: calling it will tell
        pass
    return fn


def normalise_result(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` of what a reward function returned: a number, or a dict with a numeric
    ``score`` whose other numeric (or boolean) values are extras; other values (verl's ``pred``
    strings) are left out. Raises TypeError / ValueError for anything else."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {', '.join(map(str, value))})")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))}
        return _number(value["score"]), extras
    return _number(value), {}


def _number(value: Any) -> float:
    if isinstance(value, numbers.Real):  # int, float, bool and numpy's scalars
        out = float(value)
        if not math.isfinite(out):
            raise ValueError(f"returned a non-finite score {out}")
        return out
    raise TypeError(f"returned a {type(value).__name__} ({value!r:.80}), not a number or a dict with 'score'")
