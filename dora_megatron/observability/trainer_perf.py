"""summary.json fields of the trainer's own per-step measures (``perf/trainer_*``).

WHY: the trainer reports each step's peak memory (max over its ranks), tokens per second of its
compute and, on a GPU with a known peak, its MFU (:mod:`dora_megatron.trainer.perf`); a run's summary
needs the peak over the run and the means over the measurement window to compare layouts,
precisions and recompute settings.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: per-step keys the trainer reports beside its train/* metrics (logged under their own name)
TRAINER_PERF_KEYS = ("perf/trainer_peak_memory_bytes", "perf/trainer_tokens_per_s", "perf/trainer_mfu")


def trainer_perf_summary(all_steps: Iterable[Mapping[str, Any]], window: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``trainer_peak_memory_bytes`` (max over every step), ``trainer_tokens_per_s`` and ``trainer_mfu``
    (means over the window's steps that reported them); null when no step did."""
    peaks = [float(m["perf/trainer_peak_memory_bytes"]) for m in all_steps
             if m.get("perf/trainer_peak_memory_bytes") is not None]
    out: dict[str, Any] = {"trainer_peak_memory_bytes": max(peaks) if peaks else None}
    rows = list(window)
    for key, name in (("perf/trainer_tokens_per_s", "trainer_tokens_per_s"), ("perf/trainer_mfu", "trainer_mfu")):
        values = [float(m[key]) for m in rows if m.get(key) is not None]
        out[name] = sum(values) / len(values) if values else None
    return out
