"""A training step's reported metrics from its micro-batches' reports: the sums each report
carries, added up on the rank that computed the loss, then (after the ranks' all-reduce the worker
does) divided into the step's metrics.

WHY pure and apart from :class:`~dora_megatron.trainer.worker.TrainerWorker`: what each metric is
averaged over (all response tokens, or only the on-policy samples' tokens) is arithmetic a test
can check without Megatron or a process group; the worker keeps only the reduction across ranks.
"""

from __future__ import annotations

from typing import Mapping, Sequence

#: the loss function's per-token metrics, averaged over the step's response tokens
METRIC_KEYS = ("pg_loss", "entropy", "clip_fraction", "rollout_vs_trainer_logprob_diff", "tis_weight",
               "approx_kl_behaviour", "correction_dropped_fraction")
#: Metrics averaged over the tokens of on-policy samples only (the rest are over all response tokens).
ON_POLICY_METRICS = ("rollout_vs_trainer_logprob_diff",)
#: what a report sums, in the order of the tensor the ranks all-reduce
SUM_KEYS = ("loss_sum", "denominator", "num_tokens", "num_samples", "on_policy_tokens") + METRIC_KEYS


def sum_reports(reports: Sequence[Mapping[str, float]]) -> tuple[list[float], list[float]]:
    """The sums of ``reports`` per :data:`SUM_KEYS` and whether any report had the key (1.0/0.0):
    a metric no report carries (a loss without clipping) is left out of the step, not reported 0."""
    totals, present = [0.0] * len(SUM_KEYS), [0.0] * len(SUM_KEYS)
    for rep in reports:
        for k, name in enumerate(SUM_KEYS):
            if name in rep:
                totals[k] += float(rep[name])
                present[k] = 1.0
    return totals, present


def step_metrics(totals: Sequence[float], present: Sequence[float]) -> dict[str, float]:
    """The step's metrics from the all-reduced :func:`sum_reports` of every rank: the loss over its
    denominator, the per-token metrics over the response tokens, :data:`ON_POLICY_METRICS` over
    the on-policy tokens (left out when there are none)."""
    t = dict(zip(SUM_KEYS, totals))
    ntok = max(t["num_tokens"], 1.0)
    fresh = t["on_policy_tokens"]
    metrics = {"loss": t["loss_sum"] / max(t["denominator"], 1.0), "num_tokens": t["num_tokens"],
               "num_samples": t["num_samples"], "on_policy_tokens": fresh}
    for name, here in zip(SUM_KEYS, present):
        if name in ON_POLICY_METRICS:
            if here and fresh > 0:
                metrics[name] = t[name] / fresh
        elif name in METRIC_KEYS and here:
            metrics[name] = t[name] / ntok
    return metrics
