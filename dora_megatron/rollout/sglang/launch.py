"""SGLang instances of a single-machine job: their process specs.

WHY here: the local plan lists whatever engines the configured backend needs; the SGLang argv
(:func:`dora_megatron.rollout.sglang.args.server_argv`) and GPU placement stay in this package, as
the vLLM ones do in :mod:`dora_megatron.rollout.vllm.launch`, so ``launch/plan.py`` and the SLURM
planner (``launch/cluster.py``) do not depend on each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora_megatron.processes import ProcessSpec
from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig


def local_sglang_engines(cfg: "DoraConfig", model_dir: str, port0: int | None) -> list[ProcessSpec]:
    """SGLang instances of a single-machine run: the GPUs after the trainer's (if it uses CUDA)."""
    sg = cfg.sglang
    gpu0 = cfg.launch.trainer_procs if cfg.trainer.device == "cuda" else 0
    out = []
    for i in range(cfg.rollout.num_instances):
        port = port0 + i * sg.port_stride if port0 else None
        spec = InstanceSpec(f"engine{i}", model_dir, cfg.rollout.host, port or 0, port + 1 if port else None,
                            gpu0 + i * sg.tp_size, sg.tp_size, "0", seed=cfg.run.seed + i)
        argv = list(server_argv(spec, sg, cfg.rollout, cfg.algo.wants_routed_experts))
        if not port:
            argv[argv.index("--port") + 1] = "<free-port>"
        out.append(ProcessSpec("engine", f"engine{i}", cfg.rollout.host, tuple(argv), port=port,
                               gpus=tuple(range(spec.base_gpu_id, spec.base_gpu_id + sg.tp_size)),
                               extra_ports={"nccl": port + 1} if port else {}))
    return out
