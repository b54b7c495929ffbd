"""SGLang instances of a single-machine job: their process specs.

WHY here: the local plan lists whatever engines the configured backend needs; the SGLang argv
(:func:`dora_megatron.rollout.sglang.args.server_argv`) and GPU placement stay in this package, as
the vLLM ones do in :mod:`dora_megatron.rollout.vllm.launch`, so ``launch/plan.py`` and the SLURM
planner (``launch/cluster.py``) do not depend on each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dora_megatron.processes import ProcessSpec
from dora_megatron.rollout.sglang.args import InstanceSpec, SGLangArgsError, server_argv, server_env

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig


#: EAGLE draft architectures whose ``load_weights`` keeps nothing of a dora snapshot: they prefix
#: ``model.`` to every name, so the target's names match none of their parameters (SGLang 0.5.23
#: ``models/llama_eagle.py``, ``models/qwen2_eagle.py``); docs/sglang.md, "Speculative decoding"
KEPT_EAGLE_DRAFTS = ("LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle")


def eagle_draft_problem(draft_dir: str) -> str | None:
    """Why the EAGLE draft at ``draft_dir`` would not survive dora's version switches (every disk
    update reloads it from the target's snapshot), or None. A directory this machine cannot read
    (the draft of another node) is not judged."""
    try:
        archs = json.loads((Path(draft_dir) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if archs and not set(archs) <= set(KEPT_EAGLE_DRAFTS):
        return (f"sglang.speculative_draft_model_path: {draft_dir} is a {', '.join(archs)} draft; only "
                f"{', '.join(KEPT_EAGLE_DRAFTS)} keep their weights when SGLang 0.5.23 reloads every runner "
                "from a dora snapshot (docs/sglang.md, \"Speculative decoding\")")
    return None


def local_sglang_engines(cfg: "DoraConfig", model_dir: str, port0: int | None) -> list[ProcessSpec]:
    """SGLang instances of a single-machine run: the GPUs after the trainer's (if it uses CUDA)."""
    sg = cfg.sglang
    if sg.speculative_algorithm == "EAGLE" and (problem := eagle_draft_problem(sg.speculative_draft_model_path)):
        raise SGLangArgsError(problem)
    on_cpu = cfg.rollout.device == "cpu"
    gpu0 = cfg.launch.trainer_procs if cfg.trainer.device == "cuda" else 0
    out = []
    for i in range(cfg.rollout.num_instances):
        port = port0 + i * sg.port_stride if port0 else None
        # on CPU SGLang takes the "GPU id" as the NUMA node whose cores the instance binds
        # (0.5.23 srt/utils/numa_utils.py init_threads_binding asserts it is below the number of
        # nodes): every CPU instance is a one-rank server of its own, so each starts at id 0
        base_gpu_id = 0 if on_cpu else gpu0 + i * sg.tp_size
        spec = InstanceSpec(f"engine{i}", model_dir, cfg.rollout.host, port or 0, port + 1 if port else None,
                            base_gpu_id, sg.tp_size, "0", seed=cfg.run.seed + i)
        argv = list(server_argv(spec, sg, cfg.rollout, cfg.algo.wants_routed_experts))
        if not port:
            argv[argv.index("--port") + 1] = "<free-port>"
        out.append(ProcessSpec("engine", f"engine{i}", cfg.rollout.host, tuple(argv), port=port,
                               threads=cfg.rollout.threads_per_instance if on_cpu else 1,
                               env=server_env(cfg.rollout), cpus=tuple(cfg.launch.engine_cpus) if on_cpu else (),
                               gpus=() if on_cpu else tuple(range(spec.base_gpu_id, spec.base_gpu_id + sg.tp_size)),
                               extra_ports={"nccl": port + 1} if port else {}))
    return out
