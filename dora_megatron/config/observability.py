"""Logging, metrics and trace outputs of a run."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class ObservabilityConfig:
    log_level: str = field_doc("INFO", "Python logging level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    tensorboard: bool = field_doc(True, "Write TensorBoard scalars to `<run_dir>/tb`.")
    timeline: bool = field_doc(True, "Write `timeline.png` and `trace.json` (Chrome trace, opens in Perfetto).")
    progress: bool = field_doc(True, "Show a progress bar on stderr.")
    stats_interval_s: float = field_doc(0.5, "How often the controller polls engine load (seconds).", gt=0.0)
