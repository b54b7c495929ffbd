"""What an evaluation round of the eval set (``data.eval_path``) reports: mean reward, pass@1, pass@k.

Why the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on
Code", eq. 1): with ``n`` samples of a prompt of which ``c`` pass, ``1 - C(n-c, k) / C(n, k)`` is the
expected share of size-``k`` subsets of those samples holding at least one pass, an unbiased
estimate of pass@k for any ``k <= n``; the plain "any of k passed" rate is that estimate for
``k = n`` only. Pure functions, so the numbers are checked against their definition
(tests/unit/observability/test_eval_metrics.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n-c, k) / C(n, k)`` for ``n`` samples, ``c`` passing.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (Chen et al.'s numerically stable form: no
    huge binomials). Raises ValueError unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and n >= 1, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per prompt), got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def round_metrics(rewards: Sequence[Sequence[float]], k: int, threshold: float) -> dict[str, Any]:
    """The round's figures from each prompt's sample rewards (``rewards[p]``: prompt p's samples, all
    of the same count ``n >= k``): ``mean_reward`` over every sample, ``pass@1`` and ``pass@k`` (the
    mean over prompts of :func:`pass_at_k`), a sample passing when its reward is ``>= threshold``;
    ``passes``: each prompt's count of passing samples."""
    if not rewards:
        raise ValueError("an evaluation round needs at least one prompt")
    passes = [[r >= threshold for r in rs] for rs in rewards]
    return {
        "mean_reward": statistics.fmean(r for rs in rewards for r in rs),
        "pass@1": statistics.fmean(pass_at_k(len(p), sum(p), 1) for p in passes),
        "pass@k": statistics.fmean(pass_at_k(len(p), sum(p), k) for p in passes),
        "k": k,
        "prompts": len(rewards),
        "samples": sum(len(rs) for rs in rewards),
        "passes": [sum(p) for p in passes],  # per prompt, in the eval set's order
    }


#: TensorBoard tags of a round (written at the step whose weights were evaluated)
EVAL_TAGS = {"mean_reward": "eval/mean_reward", "pass@1": "eval/pass@1", "pass@k": "eval/pass@k"}


def eval_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A round's figures under their TensorBoard / W&B tags."""
    return {tag: float(metrics[key]) for key, tag in EVAL_TAGS.items()}
