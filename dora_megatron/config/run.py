"""Run-level settings: how long, where results go, seeds."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class RunConfig:
    name: str = field_doc("dora", "Run name; used as the prefix of the run directory.")
    output_dir: str = field_doc("runs", "Parent folder of run directories (`<output_dir>/<name>-<mode>-<start time>`, "
                                        "under SLURM `...-job<SLURM_JOB_ID>`; the mode is left out when the name "
                                        "already ends with it).")
    run_dir: str = field_doc("", "Exact run directory; empty = derive from output_dir, name, mode and the start time "
                                 "(the job id under SLURM).")
    steps: int = field_doc(20, "Training steps (weight versions produced).", ge=1)
    seed: int = field_doc(1234, "Global seed: data order, sampling seeds, initial weights.", ge=0)
    checkpoint_interval: int = field_doc(0, "Save a resumable checkpoint every N steps; 0 = only at the end.", ge=0)

    def dir_name(self, mode: str, suffix: str) -> str:
        """The derived run directory's name, ``<name>-<mode>-<suffix>``. WHY the mode is left out
        when the name already ends with it: a name that says its mode (``qwen3-30b-a3b-dora``, the
        default ``dora``) would otherwise give ``...-dora-dora-...``."""
        name = self.name
        if not (name == mode or name.endswith((f"-{mode}", f"_{mode}"))):
            name = f"{name}-{mode}"
        return f"{name}-{suffix}"
