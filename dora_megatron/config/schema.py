"""The top-level job config: one typed section per component.

Cross-section rules live here (``DoraConfig.check``), section rules next to
their fields. ``load_config`` is the only entry point the CLI uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.base import ConfigError
from dora_megatron.config.cluster import ClusterConfig
from dora_megatron.config.bench import BenchConfig
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.data import DataConfig
from dora_megatron.config.launch import LaunchConfig
from dora_megatron.config.loader import apply_overrides, from_dict, read_yaml, validate
from dora_megatron.config.model import ModelConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.config.sglang import SGLangConfig
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.config.vllm import VLLMConfig


@dataclass
class DoraConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)

    def check(self, path: str) -> None:
        if self.bench.reward_source == "eval" and not (self.data.eval_path and self.observability.eval_interval):
            # without rounds during the run there is no curve: only the final round, after the last step
            raise ConfigError("bench.reward_source", "'eval' reads the eval set's rounds during each run: set "
                              f"data.eval_path (now {self.data.eval_path!r}) and observability.eval_interval "
                              f"(now {self.observability.eval_interval}) > 0")
        if self.data.is_dataset and self.model.warm_start and not self.model.path:
            # the warm start teaches the digit task: silently applied, it would train a model for
            # the wrong task before a prompt of the file is seen
            raise ConfigError("model.warm_start", f"{self.model.warm_start!r} is a supervised warm start on that digit "
                              f"task, not on data.task {self.data.task}: set model.warm_start= (empty: random init) or "
                              "model.path=DIR (a model for your prompts)")
        if self.data.is_dataset and self.trainer.max_seq_len <= self.rollout.max_new_tokens:
            raise ConfigError("trainer.max_seq_len", f"{self.trainer.max_seq_len} leaves no room for a prompt: a "
                              f"sample is a prompt plus up to rollout.max_new_tokens={self.rollout.max_new_tokens} tokens")
        if self.algo.wants_routed_experts and self.rollout.engine == "vllm":
            # the vLLM adapter has no routed-experts reply to pass on: replay would silently train unreplayed
            raise ConfigError("algo.routing_replay", "needs routed experts from the engine, which the vllm adapter "
                              "does not return: use rollout.engine embedded or sglang, or set "
                              "algo.routing_replay=false algo.router_agreement=false")
        if self.algo.wants_routed_experts and self.rollout.engine == "sglang" and self.rollout.device == "cpu":
            # SGLang 0.5.23 state_capturer/base.py pins the routed-experts host buffer with
            # cudaHostRegister (mem_cache/pool_host/common.py), also on CPU: the server dies at start
            raise ConfigError("algo.routing_replay", "needs --enable-return-routed-experts, which SGLang 0.5.23 "
                              "cannot start on CPU (its routed-experts buffer is registered with CUDA: \"Torch not "
                              "compiled with CUDA enabled\"): set algo.routing_replay=false "
                              "algo.router_agreement=false, or rollout.device cuda")
        if self.algo.wants_routed_experts and self.rollout.workflow:
            # the engine routes only the tokens it was given or generated; a trajectory ending with a tool
            # result has positions no engine call routed, so replay would meet a short routing trace
            raise ConfigError("algo.routing_replay", f"routing replay and router agreement are not wired through "
                              f"rollout.workflow {self.rollout.workflow!r} (tool tokens are never routed by the "
                              "engine): set algo.routing_replay=false algo.router_agreement=false, or no workflow")
        exported = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.trainer.precision]
        if self.rollout.engine == "embedded" and self.rollout.dtype != exported and self.controller.verify_checksums:
            raise ConfigError("controller.verify_checksums", f"must be false with rollout.dtype {self.rollout.dtype} and "
                              f"trainer.precision {self.trainer.precision}: the engine hashes its {self.rollout.dtype} "
                              f"copy, which never equals the trainer's {exported} weights (or set rollout.dtype "
                              f"{exported})")
        if self.rollout.dtype != "float32" and self.rollout.engine != "embedded":
            raise ConfigError("rollout.dtype", "applies to the embedded engine only (SGLang: pass --dtype in "
                              "rollout.sglang_args)")
        if self.orchestrator.dual_version:
            raise ConfigError("orchestrator.dual_version", "acts in the simulator (dora simulate) only: no engine "
                              "keeps a second weight set for an old version's tail yet")
        if self.observability.warmup_steps >= self.run.steps:
            raise ConfigError("observability.warmup_steps", f"{self.observability.warmup_steps} must be < run.steps "
                              f"({self.run.steps}): no step would be left to measure")
        t = self.trainer
        recomputes_router = t.recompute == "full" or "moe" in (t.megatron.get("recompute_modules") or ())
        if self.algo.routing_replay and recomputes_router and t.pp > 1:
            # the recompute of a micro-batch's router runs in its backward, after the pipeline already set
            # the routers to a later micro-batch's engine experts: it would replay the wrong tokens' routing
            raise ConfigError("algo.routing_replay", f"cannot replay through trainer.recompute {t.recompute} (the "
                              f"routers run again in the backward) with trainer.pp={t.pp} (micro-batches in flight): "
                              "use recompute selective (core attention), pp 1, or no replay")
        if t.cp > 1 and self.algo.length_norm != "token_mean":
            # a context-parallel rank holds chunks of every sample: per-sample means need whole samples
            raise ConfigError("algo.length_norm", f"{self.algo.length_norm} normalises per sample, but with "
                              f"trainer.cp={t.cp} each rank holds only chunks of a sample: use token_mean")
        if t.cp > 1 and self.algo.wants_routed_experts:
            raise ConfigError("algo.routing_replay", f"routing replay and router agreement are not wired through "
                              f"context parallelism (trainer.cp={t.cp}): set algo.routing_replay=false "
                              "algo.router_agreement=false")
        decay_end = t.lr_decay_steps or self.run.steps
        if t.lr_warmup_steps and t.lr_warmup_steps >= decay_end:
            raise ConfigError("trainer.lr_warmup_steps", f"{t.lr_warmup_steps} must be below the end of the decay "
                              f"({'trainer.lr_decay_steps' if t.lr_decay_steps else 'run.steps'}={decay_end})")
        procs = self.launch.trainer_procs
        try:
            t.data_parallel_size(procs)
        except ConfigError as err:
            raise ConfigError(
                "launch.trainer_procs",
                f"{procs} trainer processes do not fit trainer tp={t.tp} pp={t.pp} cp={t.cp} ep={t.ep} etp={t.etp} "
                f"dp={t.dp}: {err}",
            ) from err


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> DoraConfig:
    """Load ``path`` (or the defaults), apply ``a.b=c`` overrides and validate."""
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides)
    cfg = from_dict(DoraConfig, data)
    validate(cfg)
    return cfg
