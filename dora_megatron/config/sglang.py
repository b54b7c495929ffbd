"""``sglang:`` section: how each SGLang rollout instance is launched and updated (``rollout.engine: sglang``).

WHY a section of its own: SGLang flags (TP/EP shape, EPLB, memory fraction) and the weight-update
choreography (pause mode, flush, bucket size) are production concerns that the embedded engine
ignores; keeping them together lets the launcher, the SLURM planner and the weight pusher agree.
Flag names follow SGLang 0.5.x ``ServerArgs`` (reference A.2); anything not covered here goes
through ``rollout.sglang_args`` verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_megatron.config.base import ConfigError, field_doc
from dora_megatron.comm.protocol import PAUSE_MODES


@dataclass
class SGLangConfig:
    """SGLang instance shape, EPLB and weight-update settings (used when rollout.engine is sglang)."""

    # keys that existed once and did not act: {key: (old default, why)}; see loader.from_dict
    REMOVED_KEYS: ClassVar[dict[str, tuple[Any, str]]] = {
        "skip_tokenizer_init": (True, "dora always starts SGLang with --skip-tokenizer-init (the controller sends "
                                      "token ids and reads output_ids; the engine never tokenizes); delete the key"),
        "enable_dp_attention": (False, "SGLang 0.5.23 ignores --enable-dp-attention: set sglang.attn_dp_size "
                                       "(--attn-dp-size) instead"),
    }

    python: str = field_doc("", "Python interpreter that has sglang installed (it pins its own torch); empty = the one running dora.")
    tp_size: int = field_doc(1, "GPUs per instance (`--tp-size`); an instance may span nodes when larger than the GPUs of a node.", ge=1)
    ep_size: int = field_doc(1, "expert-parallel size inside an instance (`--ep-size`, carved out of tp_size).", ge=1)
    moe_a2a_backend: str = field_doc("none", "MoE all-to-all backend (`--moe-a2a-backend`).",
                                     choices=("none", "deepep", "mooncake", "nixl", "mori", "flashinfer"))
    attn_dp_size: int = field_doc(1, "`--attn-dp-size`: data-parallel attention groups inside an instance (attention DP, FFN stays TP; SGLang 0.5.23 ignores the deprecated `--enable-dp-attention`); divides tp_size.", ge=1)
    enable_eplb: bool = field_doc(False, "`--enable-eplb`: expert-parallel load balancing (needs ep_size > 1).")
    eplb_algorithm: str = field_doc("auto", "`--eplb-algorithm`.")
    eplb_rebalance_num_iterations: int = field_doc(1000, "`--eplb-rebalance-num-iterations`: forward passes between rebalances.", ge=1)
    ep_num_redundant_experts: int = field_doc(0, "`--ep-num-redundant-experts` (extra physical expert replicas).", ge=0)
    mem_fraction_static: float | None = field_doc(None, "`--mem-fraction-static` (weights + KV pool share of GPU memory); null = SGLang's choice.", gt=0.0, lt=1.0)
    load_format: str = field_doc("auto", "`--load-format` (`dummy` when every version is pushed by the trainer).")
    context_length: int | None = field_doc(None, "`--context-length`; null = the model's.", ge=2)
    disable_radix_cache: bool = field_doc(False, "`--disable-radix-cache`.")
    port_stride: int = field_doc(10, "Ports of instance j on a node: http = rollout.base_port + j*stride, nccl = +1, dist-init = +2.", ge=3)
    health_path: str = field_doc("/health_generate", "Endpoint polled until 200 before an instance is used.", choices=("/health", "/health_generate"))
    pause_mode: str = field_doc("abort", "`/pause_generation` mode of the `distributed` weight transport before its first bucket (abort returns partial outputs; retract keeps requests queued and flushes the cache, so they recompute their KV on the new weights; in_place keeps them running on the old KV, no flush). The bucket size is `controller.bucket_mb`.", choices=PAUSE_MODES)
    weight_group_backend: str = field_doc("nccl", "torch.distributed backend of the trainer -> instances weight-update group (`controller.weight_transport: distributed`); nccl needs the trainer on CUDA.", choices=("nccl", "gloo"))

    def check(self, path: str) -> None:
        if self.ep_size > self.tp_size or self.tp_size % self.ep_size:
            raise ConfigError(f"{path}.ep_size", f"must divide tp_size ({self.tp_size}); SGLang carves EP out of TP")
        if self.tp_size % self.attn_dp_size:
            raise ConfigError(f"{path}.attn_dp_size", f"must divide tp_size ({self.tp_size}); attention DP groups split the TP group")
        if self.moe_a2a_backend == "flashinfer" and self.attn_dp_size != self.tp_size:
            raise ConfigError(f"{path}.attn_dp_size", f"moe_a2a_backend flashinfer needs attn_dp_size == tp_size "
                                                      f"({self.tp_size}); SGLang 0.5.23 refuses to start otherwise")
        if self.enable_eplb and self.ep_size <= 1:
            raise ConfigError(f"{path}.enable_eplb", "needs ep_size > 1 (SGLang asserts it)")
        if self.ep_num_redundant_experts and not self.enable_eplb:
            raise ConfigError(f"{path}.ep_num_redundant_experts", "redundant experts need enable_eplb")
