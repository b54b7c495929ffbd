"""Process placement: which processes run where, with how many CPU threads.

Engine placement (count, ports, threads) lives in ``rollout``; this section
holds the trainer job and the launcher itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc


@dataclass
class LaunchConfig:
    backend: str = field_doc("local", "`local`: every process on this machine; `slurm`: roles from the SLURM environment.", choices=("local", "slurm"))
    trainer_procs: int = field_doc(1, "torchrun processes of the trainer (must fit trainer tp*pp*dp).", ge=1)
    engine_cpus: list[int] = field_doc(default_factory=list, doc="CPU cores the engine processes are pinned to (empty = no pinning).")
    trainer_cpus: list[int] = field_doc(default_factory=list, doc="CPU cores the trainer processes are pinned to (empty = no pinning).")
    trainer_threads: int = field_doc(1, "torch CPU threads per trainer process.", ge=1)
    trainer_port: int = field_doc(0, "Port of the trainer service (rank 0, loopback); 0 picks a free port.", ge=0, le=65535)
    port_range: list[int] = field_doc(default_factory=list, doc="`[lo, hi]`: every service of a job (trainer "
                                      "rendezvous, trainer service, weight-update store, each rollout instance) binds "
                                      "a port of this range that is free on its node when it starts, and publishes "
                                      "the bound address in `<run_dir>/addresses/` (for sites whose firewall opens "
                                      "only a range). Empty: `[25000, first port of the kernel's ephemeral range - "
                                      "1]`. A port a `cluster.*_port` or `rollout.base_port` fixes is used as given.")
    trainer_startup_timeout_s: float = field_doc(300.0, "How long to wait for the trainer to build the model and report ready.", gt=0.0, unit="s")
    shutdown_timeout_s: float = field_doc(20.0, "Grace period for processes to exit before they are killed.", gt=0.0, unit="s")
    restart_engines: bool = field_doc(True, "Local runs: restart an engine process that died (or that the controller "
                                      "failed, e.g. it stopped answering or a weight load timed out) once the "
                                      "controller has re-queued its requests; the new process starts on a fresh free "
                                      "port (the same port when `rollout.base_port` is fixed), and once `/health` "
                                      "answers it rejoins the pool and is switched to the version the orchestrator "
                                      "assigns (the newest). SLURM jobs: every node's launcher restarts its own "
                                      "instances on a fresh free port of `launch.port_range` (the same port when "
                                      "`cluster.rollout_base_port` is fixed) and publishes the new address; one on another node than the controller's asks "
                                      "to rejoin through the join folder (see slurm/README.md).")
    max_engine_restarts: int = field_doc(3, "Restarts allowed per engine (each start attempt counts); after that the "
                                         "engine stays failed and the run continues on the others. Restarts "
                                         "while the job starts count too.", ge=0)
    max_trainer_restarts: int = field_doc(2, "Restarts of a lost trainer (its process died, or it did not answer "
                                          "within `controller.trainer_timeout_s`) within one job. The rollout "
                                          "instances keep running; the trainer restarts from the last complete "
                                          "checkpoint (the initial weights when there is none), the controller "
                                          "goes back to the same cut (steps after it are trained again, each group "
                                          "once; instances are switched back to the cut's versions) and the run "
                                          "goes on. When none is left the job fails naming the cause (SLURM: "
                                          "FAILED); `--resume` continues it. 0: a lost trainer ends the job. "
                                          "SLURM jobs restart the trainer on its node(s), the same way.", ge=0)
    secret_file: str = field_doc("", "A file (mode 0600, one word of at least 32 characters, not starting with `-`) holding the job's secret: "
                                 "every endpoint of the job asks for it (`Authorization: Bearer`). Empty (the "
                                 "default): the job makes one (256 bits) at its first start in `<run_dir>/secret` "
                                 "(0600), and `--resume`/`--join` read it there; delete that file before a "
                                 "`--resume` to rotate it. Never written to `config.yaml`, a log or the outputs.")
    min_ready_instances: int | float | None = field_doc(
        None, "Rollout instances that must be ready before the first step. Empty (the default): every "
        "instance that did not fail -- the start waits until each one is ready or has failed (its process "
        "exited, or it is not healthy within `rollout.startup_timeout_s`) and needs at least one ready. "
        "An integer is a count (1 .. the job's instances), a number with a decimal point a fraction of "
        "them, rounded up (`1.0`: all, `0.9`: 90%); the start then comes as soon as that many are "
        "ready. Instances not ready at the start join the pool once they serve; failed ones are "
        "restarted under `max_engine_restarts`. The job refuses to start, naming each instance not "
        "ready and its last error line, when fewer than the minimum are ready within "
        "`rollout.startup_timeout_s` or can still become so.")

    def check(self, path: str) -> None:
        if self.port_range:
            r = self.port_range
            if len(r) != 2 or not 1 <= r[0] <= r[1] <= 65535:
                raise ConfigError(f"{path}.port_range", f"expected [lo, hi] with 1 <= lo <= hi <= 65535, got {r}")
        m = self.min_ready_instances
        if isinstance(m, int) and m < 1:
            raise ConfigError(f"{path}.min_ready_instances", f"a count must be >= 1, got {m}")
        if isinstance(m, float) and not 0.0 < m <= 1.0:
            raise ConfigError(f"{path}.min_ready_instances", f"a fraction must be in (0, 1], got {m}")
