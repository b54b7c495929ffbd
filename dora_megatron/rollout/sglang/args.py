"""Command lines of SGLang servers, computed from the config by pure functions.

WHY pure: the local launcher, the SLURM planner and ``dora train --dry-run`` all print or run
exactly these argv tuples, and tests check them without SGLang installed. Flag names are those of
SGLang 0.5.x ``ServerArgs`` (``--tp-size``, ``--ep-size``, ``--enable-eplb`` ...; reference A.2);
``--enable-ep-moe`` no longer exists there and is never emitted, nor ``--enable-dp-attention``
(deprecated in 0.5.23: attention DP comes from ``--attn-dp-size``). Flags the user passes through
``rollout.sglang_args`` may not repeat one that dora sets (the plan would be ambiguous).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dora_megatron.config.sglang import NGRAM_DEFAULTS

if TYPE_CHECKING:
    from dora_megatron.config.rollout import RolloutConfig
    from dora_megatron.config.sglang import SGLangConfig


class SGLangArgsError(ValueError):
    """The instance cannot be described with the supported flags."""


@dataclass(frozen=True)
class InstanceSpec:
    """One SGLang instance (or, when ``nnodes > 1``, the part of it on one node)."""

    name: str
    model_path: str
    host: str  # address the HTTP server binds to
    port: int
    nccl_port: int | None  # None: SGLang picks one (local runs)
    base_gpu_id: int
    tp_size: int
    weight_version: str = "0"
    seed: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of node_rank 0 when nnodes > 1

    @property
    def gpus_here(self) -> int:
        return self.tp_size // self.nnodes


def dora_flags(inst: InstanceSpec, sg: "SGLangConfig", rollout: "RolloutConfig", routed_experts: bool = False
               ) -> list[str]:
    """The flags dora sets for ``inst`` (without the interpreter and module); ``routed_experts``
    (``algo.routing_replay`` / ``router_agreement``) adds ``--enable-return-routed-experts``."""
    if inst.tp_size != sg.tp_size:
        raise SGLangArgsError(f"{inst.name}: tp_size {inst.tp_size} differs from sglang.tp_size {sg.tp_size}")
    if inst.tp_size % inst.nnodes:
        raise SGLangArgsError(f"{inst.name}: tp_size {inst.tp_size} not divisible by nnodes {inst.nnodes}")
    if inst.nnodes > 1 and not inst.dist_init_addr:
        raise SGLangArgsError(f"{inst.name}: a multi-node instance needs dist_init_addr")
    a = [
        "--model-path", inst.model_path,
        "--host", inst.host, "--port", str(inst.port),
        "--tp-size", str(inst.tp_size),
        "--base-gpu-id", str(inst.base_gpu_id), "--gpu-id-step", "1",
        "--weight-version", str(inst.weight_version),
        "--random-seed", str(inst.seed),
        "--max-running-requests", str(rollout.max_running),
        "--skip-tokenizer-init",
    ]
    if inst.nccl_port is not None:
        a += ["--nccl-port", str(inst.nccl_port)]
    if sg.ep_size > 1:
        a += ["--ep-size", str(sg.ep_size)]
    if sg.moe_a2a_backend != "none":
        a += ["--moe-a2a-backend", sg.moe_a2a_backend]
    if sg.attn_dp_size > 1:  # 0.5.23: --enable-dp-attention is deprecated and sets nothing by itself
        a += ["--attn-dp-size", str(sg.attn_dp_size)]
    if sg.enable_eplb:
        a += ["--enable-eplb", "--eplb-algorithm", sg.eplb_algorithm,
              "--eplb-rebalance-num-iterations", str(sg.eplb_rebalance_num_iterations)]
        if sg.ep_num_redundant_experts:
            a += ["--ep-num-redundant-experts", str(sg.ep_num_redundant_experts)]
    if sg.mem_fraction_static is not None:
        a += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if sg.load_format != "auto":
        a += ["--load-format", sg.load_format]
    context = sg.context_length or rollout.context_length
    if context:
        a += ["--context-length", str(context)]
    if sg.disable_radix_cache:
        a += ["--disable-radix-cache"]
    a += cpu_flags(sg, rollout)
    if routed_experts:
        a += ["--enable-return-routed-experts"]
    a += speculative_flags(sg)
    if inst.nnodes > 1:
        a += ["--nnodes", str(inst.nnodes), "--node-rank", str(inst.node_rank), "--dist-init-addr", str(inst.dist_init_addr)]
    return a


def cpu_flags(sg: "SGLangConfig", rollout: "RolloutConfig") -> list[str]:
    """``--device cpu`` (``rollout.device: cpu``) and the scheduler/kernel flags of the ``sglang:``
    section that a CPU instance needs (names of 0.5.23's ``arg_groups/fields``: ``device.py``,
    ``exec_.py``, ``schedule.py``). On CUDA only the flags the user set are emitted."""
    a = ["--device", "cpu"] if rollout.device == "cpu" else []
    if sg.attention_backend:
        a += ["--attention-backend", sg.attention_backend]
    if not sg.cuda_graph:
        a += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if sg.disable_overlap_schedule:
        a += ["--disable-overlap-schedule"]
    if sg.max_total_tokens is not None:
        a += ["--max-total-tokens", str(sg.max_total_tokens)]
    if sg.sleep_on_idle:
        a += ["--sleep-on-idle"]
    return a


def server_env(rollout: "RolloutConfig") -> dict[str, str]:
    """Environment of an SGLang instance. On CPU: ``SGLANG_USE_CPU_ENGINE=1`` (0.5.23's
    ``srt/platforms/__init__.py`` picks the CPU platform only with it) and one OpenMP pool of
    ``rollout.threads_per_instance`` threads (on a shared machine more threads than cores slow
    every instance down)."""
    if rollout.device != "cpu":
        return {}
    threads = str(rollout.threads_per_instance)
    return {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def speculative_flags(sg: "SGLangConfig") -> list[str]:
    """``--speculative-*`` flags of ``sglang.speculative_*`` (none when the algorithm is none).

    Unset numbers are left out so SGLang picks them for the model (``speculative_hook.py``
    ``_auto_choose_speculative_params``, NGRAM's defaults). A draft model is loaded from its
    checkpoint (``--speculative-draft-load-format auto``) when the target starts with
    ``--load-format dummy``: SGLang would give the draft the target's format, and no update of
    dora ever fills the draft's weights (docs/sglang.md, "Speculative decoding")."""
    algo = sg.speculative_algorithm
    if algo == "none":
        return []
    a = ["--speculative-algorithm", algo]
    if sg.speculative_draft_model_path:
        a += ["--speculative-draft-model-path", sg.speculative_draft_model_path]
    if sg.has_draft_model and sg.load_format == "dummy":
        a += ["--speculative-draft-load-format", "auto"]
    for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if getattr(sg, key) is not None:
            a += ["--" + key.replace("_", "-"), str(getattr(sg, key))]
    if algo == "NGRAM":
        for key in NGRAM_DEFAULTS:
            a += ["--" + key.replace("_", "-"), str(getattr(sg, key))]
    return a


def _flag_names(args: list[str]) -> set[str]:
    return {x.split("=", 1)[0] for x in args if x.startswith("--")}


def server_argv(inst: InstanceSpec, sg: "SGLangConfig", rollout: "RolloutConfig", routed_experts: bool = False
                ) -> tuple[str, ...]:
    """``python -m sglang.launch_server`` plus every flag, user flags last."""
    ours = dora_flags(inst, sg, rollout, routed_experts)
    user = list(rollout.sglang_args)
    clash = sorted(_flag_names(ours) & _flag_names(user))
    if clash:
        raise SGLangArgsError(f"rollout.sglang_args repeats flags dora sets from the config: {', '.join(clash)} "
                              "(set them through the sglang: section instead)")
    spec = sorted(f for f in _flag_names(user) if f.startswith("--speculative"))
    if spec:  # the draft rules (which algorithms dora's weight updates keep intact) need them in the config
        raise SGLangArgsError(f"rollout.sglang_args sets {', '.join(spec)}: set speculative decoding through "
                              "sglang.speculative_* instead")
    python = os.path.expanduser(sg.python) if sg.python else sys.executable
    return (python, "-m", "sglang.launch_server", *ours, *user)
