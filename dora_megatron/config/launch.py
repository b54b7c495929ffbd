"""Process placement: which processes run where, with how many CPU threads."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class LaunchConfig:
    backend: str = field_doc("local", "`local`: every process on this machine; `slurm`: roles from the SLURM environment.", choices=("local", "slurm"))
    host: str = field_doc("127.0.0.1", "Address the local processes bind to (loopback by default).")
    trainer_procs: int = field_doc(1, "torchrun processes of the trainer (must equal tp*pp*dp of the trainer).", ge=1)
    trainer_threads: int = field_doc(1, "torch CPU threads per trainer process.", ge=1)
    engine_threads: int = field_doc(1, "torch CPU threads per embedded engine process.", ge=1)
    startup_timeout_s: float = field_doc(180.0, "How long to wait for every process to report healthy.", gt=0.0)
    request_timeout_s: float = field_doc(600.0, "An engine that does not answer a request for this long is treated as failed.", gt=0.0)
