"""``cluster:`` section: how a SLURM allocation is split into roles (``launch.backend: slurm``).

WHY: the same config must give the same plan on every node of a job (each node runs ``dora train``
and starts only its own processes), so the split into trainer and rollout nodes is config, not discovered at run time. Ports
are not: by default each service binds a port free on its node and publishes it in the run
directory (``dora_megatron.launch.addresses``); a fixed port here is for sites that need one. Hosts and GPUs per node come from the SLURM
environment (see ``dora_megatron.launch.slurm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc


@dataclass
class ClusterConfig:
    """Role assignment (and optional fixed ports) of a multi-node (SLURM) job."""

    trainer_nodes: int = field_doc(1, "Nodes running the torchrun trainer (the first nodes of the allocation).", ge=1)
    rollout_nodes: int = field_doc(0, "Nodes running rollout instances, after the trainer nodes; 0 = every remaining node.", ge=0)
    gpu_memory_gb: float = field_doc(0.0, "Memory of one trainer GPU; `dora train` (and its --dry-run, which prints the trainer's per-rank memory estimate) refuses a trainer layout whose estimate exceeds it; 0 = unknown, no check.", ge=0.0, unit="GiB")
    gpus_per_node: int = field_doc(0, "GPUs per node; 0 = from SLURM (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE / SLURM_JOB_GPUS).", ge=0)
    share_node: bool = field_doc(False, "Single-node jobs only: trainer and rollout instances share the node's GPUs (trainer first).")
    trainer_gpus: int = field_doc(0, "With share_node: GPUs given to the trainer (the rest go to rollout); 0 = half.", ge=0)
    torchrun_port: int = field_doc(0, "torchrun rendezvous port on the first trainer node; 0 = a free port of launch.port_range, published in `<run_dir>/addresses/torchrun` for the other trainer nodes.", ge=0, le=65535)
    trainer_service_port: int = field_doc(0, "Port of the trainer service (rank 0) the controller calls; 0 = a free port of launch.port_range.", ge=0, le=65535)
    weight_group_port: int = field_doc(0, "Store port (on trainer rank 0) of the trainer -> rollout weight-update group of the `distributed` weight transport; 0 = a free port of launch.port_range per push.", ge=0, le=65535)
    rollout_base_port: int = field_doc(0, "HTTP port of the first instance on each rollout node (see sglang.port_stride); 0 = each instance binds a free port of launch.port_range when it starts (again at each restart) and publishes it in `<run_dir>/addresses/<instance>`.", ge=0, le=65535)
    join_dir: str = field_doc("", "Elastic pools: folder watched for join requests of new instances; empty = `<run_dir>/join`.")
    join_poll_s: float = field_doc(5.0, "How often the controller looks for join requests (and refreshes its heartbeat `<join_dir>/controller.alive`).", gt=0.0, unit="s")
    join_timeout_s: float = field_doc(600.0, "`--join`: how long a joining node waits for a live controller (a heartbeat younger than this) before it exits with a message; also how long it keeps serving after the heartbeat stops without DONE/FAILED.", gt=0.0, unit="s")

    def check(self, path: str) -> None:
        fixed = {"torchrun_port": self.torchrun_port, "trainer_service_port": self.trainer_service_port,
                 "weight_group_port": self.weight_group_port}
        seen: dict[int, str] = {}
        for name, port in fixed.items():
            if port and port in seen:
                raise ConfigError(f"{path}.{name}", f"port {port} also used by {seen[port]}")
            seen[port] = name
        if self.share_node and self.trainer_nodes != 1:
            raise ConfigError(f"{path}.share_node", "only for single-node jobs (trainer_nodes must be 1)")
