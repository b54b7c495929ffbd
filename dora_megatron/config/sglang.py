"""``sglang:`` section: how each SGLang rollout instance is launched and updated (``rollout.engine: sglang``).

WHY a section of its own: SGLang flags (TP/EP shape, EPLB, memory fraction) and the weight-update
choreography (pause mode, flush, bucket size) are production concerns that the embedded engine
ignores; keeping them together lets the launcher, the SLURM planner and the weight pusher agree.
Flag names follow SGLang 0.5.x ``ServerArgs`` (reference A.2); anything not covered here goes
through ``rollout.sglang_args`` verbatim.

Speculative decoding (``speculative_*``) is SGLang's own (``--speculative-algorithm`` and its
companion flags, ``srt/arg_groups/fields/spec.py`` of 0.5.23); the checks below are the ones
SGLang 0.5.23 applies at start-up (``srt/arg_groups/speculative_hook.py``), made here so a bad
value names its key before any GPU is taken, plus the one rule that comes from dora's weight
updates: a draft model that dora's version switches would overwrite is refused (EAGLE3, see
docs/sglang.md "Speculative decoding").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_megatron.config.base import ConfigError, field_doc
from dora_megatron.comm.protocol import PAUSE_MODES

#: the interpreter of the venv ``tools/setup_sglang_cpu.sh`` builds by default (SGLang 0.5.23 on CPU)
CPU_SGLANG_PYTHON = "~/.cache/dora_megatron/sglang-cpu-0.5.23/bin/python"
#: ``--speculative-algorithm`` values dora passes on (names of SGLang 0.5.23's
#: ``SpeculativeAlgorithm`` enum, ``srt/speculative/spec_info.py``, or its alias ``NEXTN``)
SPECULATIVE_ALGORITHMS = ("none", "NGRAM", "EAGLE", "EAGLE3", "NEXTN")
#: algorithms with a draft model in its own runner (SGLang's ``draft_worker.draft_runners``)
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
#: the NGRAM keys and SGLang 0.5.23's defaults for them (``fields/spec.py``): they act only with NGRAM
NGRAM_DEFAULTS = {"speculative_ngram_min_bfs_breadth": 1, "speculative_ngram_max_bfs_breadth": 10,
                  "speculative_ngram_match_type": "BFS", "speculative_ngram_max_trie_depth": 18,
                  "speculative_ngram_capacity": 10_000_000}


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

    python: str = field_doc("", "Python interpreter that has sglang installed (it pins its own torch; on CPU `tools/setup_sglang_cpu.sh` builds one at ~/.cache/dora_megatron/sglang-cpu-0.5.23/bin/python; `~` is expanded); empty = the one running dora.")
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
    attention_backend: str = field_doc("", "`--attention-backend`; empty = SGLang's choice for the device. On CPU (`rollout.device: cpu`) use torch_native (configs/cpu_sglang.yaml).")
    cuda_graph: bool = field_doc(True, "false: `--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled` (0.5.23's spelling of the deprecated `--disable-cuda-graph`); CPU runs need false.")
    disable_overlap_schedule: bool = field_doc(False, "`--disable-overlap-schedule`: the scheduler prepares the next batch after the current one instead of during it (CPU runs: one thread, nothing to overlap).")
    max_total_tokens: int | None = field_doc(None, "`--max-total-tokens`: size of the KV pool in tokens; null = SGLang's choice from mem_fraction_static (on CPU, set it: SGLang sizes the pool from the machine's memory).", ge=1)
    sleep_on_idle: bool = field_doc(False, "`--sleep-on-idle`: the idle scheduler waits instead of polling (on CPU an idle instance otherwise spins a whole core).")
    port_stride: int = field_doc(10, "With a fixed cluster.rollout_base_port (SLURM) or rollout.base_port: ports of instance j on a node are http = base + j*stride, nccl = +1, dist-init = +2 (otherwise each port is picked free, see launch.port_range).", ge=3)
    health_path: str = field_doc("/health_generate", "Endpoint polled until 200 before an instance is used.", choices=("/health", "/health_generate"))
    pause_mode: str = field_doc("abort", "`/pause_generation` mode of the `distributed` weight transport before its first bucket (abort returns partial outputs; retract keeps requests queued and flushes the cache, so they recompute their KV on the new weights; in_place keeps them running on the old KV, no flush). The bucket size is `controller.bucket_mb`.", choices=PAUSE_MODES)
    speculative_algorithm: str = field_doc("none", "`--speculative-algorithm`: none, NGRAM (drafts from the request's own tokens, no draft model), EAGLE (a separate EAGLE draft model, kept as loaded: dora's weight updates never reach it), EAGLE3 (refused: dora's version switches would overwrite its draft, see docs/sglang.md), NEXTN (the MTP layers of the target's checkpoint; they share its embedding and LM head, which follow every update).", choices=SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: str = field_doc("", "`--speculative-draft-model-path`: the draft model's directory (required by EAGLE; NEXTN: empty = the target's checkpoint, as SGLang sets it for the architectures that carry MTP layers).")
    speculative_num_steps: int | None = field_doc(None, "`--speculative-num-steps`: draft steps per verify (EAGLE/NEXTN); set with eagle_topk and num_draft_tokens, or all three null = SGLang's choice for the model.", ge=1)
    speculative_eagle_topk: int | None = field_doc(None, "`--speculative-eagle-topk`: draft tokens branched per step (EAGLE/NEXTN, set with num_steps; NGRAM takes it from speculative_ngram_max_bfs_breadth).", ge=1)
    speculative_num_draft_tokens: int | None = field_doc(None, "`--speculative-num-draft-tokens`: tokens verified per step; null = SGLang's choice (12 for NGRAM); with eagle_topk 1 it must be num_steps + 1.", ge=2)
    speculative_ngram_min_bfs_breadth: int = field_doc(1, "`--speculative-ngram-min-bfs-breadth` (NGRAM only).", ge=1)
    speculative_ngram_max_bfs_breadth: int = field_doc(10, "`--speculative-ngram-max-bfs-breadth` (NGRAM only; also its eagle topk).", ge=1)
    speculative_ngram_match_type: str = field_doc("BFS", "`--speculative-ngram-match-type` (NGRAM only).", choices=("BFS", "PROB"))
    speculative_ngram_max_trie_depth: int = field_doc(18, "`--speculative-ngram-max-trie-depth` (NGRAM only).", ge=1)
    speculative_ngram_capacity: int = field_doc(10_000_000, "`--speculative-ngram-capacity`: n-gram cache entries (NGRAM only).", ge=1)
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
        self._check_speculative(path)

    @property
    def has_draft_model(self) -> bool:
        """A draft model runs beside the target (EAGLE, NEXTN): it is loaded from its own checkpoint
        and never receives dora's weight updates."""
        return self.speculative_algorithm in DRAFT_MODEL_ALGORITHMS

    def _check_speculative(self, path: str) -> None:
        """SGLang 0.5.23's start-up rules (``arg_groups/speculative_hook.py``), each naming its key."""
        algo = self.speculative_algorithm
        if algo == "none":
            for key in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                        "speculative_num_draft_tokens", *NGRAM_DEFAULTS):
                if getattr(self, key) not in (None, "", NGRAM_DEFAULTS.get(key)):
                    raise ConfigError(f"{path}.{key}", "acts only with a speculative_algorithm; it is none")
            return
        if algo == "EAGLE3":
            raise ConfigError(f"{path}.speculative_algorithm",
                              "EAGLE3 is refused: SGLang 0.5.23 reloads every runner, the draft's included, on "
                              "/update_weights_from_disk (no selector), which is how dora switches an instance's "
                              "version, and an EAGLE3 draft takes the target's model.layers.0.* tensors as its own "
                              "(models/llama_eagle3.py load_weights); use EAGLE, NEXTN or NGRAM")
        if algo != "NGRAM":
            for key in NGRAM_DEFAULTS:
                if getattr(self, key) != NGRAM_DEFAULTS[key]:
                    raise ConfigError(f"{path}.{key}", f"acts only with speculative_algorithm NGRAM, not {algo}")
        if algo == "NGRAM":
            for key in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, key) not in (None, ""):
                    raise ConfigError(f"{path}.{key}", "NGRAM has no draft model: SGLang derives num_steps and "
                                                       "eagle_topk from speculative_ngram_max_bfs_breadth")
            if self.speculative_ngram_min_bfs_breadth > self.speculative_ngram_max_bfs_breadth:
                raise ConfigError(f"{path}.speculative_ngram_min_bfs_breadth",
                                  f"{self.speculative_ngram_min_bfs_breadth} exceeds speculative_ngram_max_bfs_breadth "
                                  f"({self.speculative_ngram_max_bfs_breadth})")
            if self.attn_dp_size > 1:
                raise ConfigError(f"{path}.attn_dp_size", "SGLang 0.5.23 refuses NGRAM speculative decoding with "
                                                          "attention DP (attn_dp_size > 1)")
            return
        if algo == "EAGLE" and not self.speculative_draft_model_path:
            raise ConfigError(f"{path}.speculative_draft_model_path", "EAGLE needs the draft model's directory")
        shape = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        unset = [key for key in shape if getattr(self, key) is None]
        if len(unset) == len(shape):
            return  # SGLang chooses all three for the model
        if unset:  # SGLang asserts topk and draft tokens unset with num_steps, and compares topk given num_steps
            raise ConfigError(f"{path}.{unset[0]}", f"set {', '.join(shape)} together or leave all three null "
                                                    "(SGLang then chooses them for the model)")
        topk = self.speculative_eagle_topk
        draft = self.speculative_num_draft_tokens
        if topk == 1 and draft is not None and draft != self.speculative_num_steps + 1:
            raise ConfigError(f"{path}.speculative_num_draft_tokens",
                              f"with speculative_eagle_topk 1 SGLang sets it to speculative_num_steps + 1 "
                              f"({self.speculative_num_steps + 1}), not {draft}")
