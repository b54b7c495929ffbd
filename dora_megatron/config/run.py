"""Run-level settings: how long, where results go, seeds."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class RunConfig:
    name: str = field_doc("dora", "Run name; used as the prefix of the run directory.")
    output_dir: str = field_doc("runs", "Parent folder of run directories (`<output_dir>/<name>-<timestamp>`).")
    run_dir: str = field_doc("", "Exact run directory; empty = derive from output_dir, name and the start time.")
    steps: int = field_doc(20, "Training steps (weight versions produced).", ge=1)
    seed: int = field_doc(1234, "Global seed: data order, sampling seeds, initial weights.", ge=0)
    checkpoint_interval: int = field_doc(0, "Save a resumable checkpoint every N steps; 0 = only at the end.", ge=0)
