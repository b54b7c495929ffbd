"""summary.json fields for MoE routing replay (R3), from the per-step trainer metrics.

WHY: the per-step values go to TensorBoard / steps.jsonl as ``train/router_topk_agreement`` and
``train/routing_replay``; a run's summary needs their aggregate to compare runs with and without
replay (docs/results/routing_replay.md) next to ``rollout_vs_trainer_logprob_diff_mean``.
"""

from __future__ import annotations

from typing import Any, Iterable


def routing_summary(step_metrics: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``router_topk_agreement`` (mean over the steps that measured it), its min, and the replayed step count."""
    agree, replayed = [], 0
    for m in step_metrics:
        if m.get("router_topk_agreement") is not None:
            agree.append(float(m["router_topk_agreement"]))
        replayed += int(bool(m.get("routing_replay")))
    return {"router_topk_agreement": sum(agree) / len(agree) if agree else None,
            "router_topk_agreement_min": min(agree) if agree else None,
            "routing_replay_steps": replayed}
