"""Simulator configuration: cluster shape, instance/trainer cost model, workload.

WHY: the simulator answers "how fast would mode M be on cluster C with workload W" before a
cluster-day is spent, so every number that shapes the answer is a documented YAML field with a
unit, and the configs under ``configs/sim/`` justify their values (``configs/sim/README.md``).
The orchestrator policy itself is *not* duplicated here: a sim YAML embeds an ``orchestrator:``
mapping that is loaded into the production :class:`OrchestratorConfig` (same strict loader), so
the simulator runs exactly the policy a real run would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dora_megatron.config.base import ConfigError, field_doc
from dora_megatron.config.rollout import (
    spec_max_batch_field,
    spec_probe_interval_field,
    spec_tokens_field,
    speculative_field,
)

PLACEMENTS = ("colocated", "disaggregated")
log = logging.getLogger(__name__)

DIST_KINDS = ("lognormal", "empirical", "point", "mixture")


@dataclass
class LengthDistConfig:
    """A token-length distribution (prompt or response)."""

    kind: str = field_doc("lognormal", "lognormal | empirical | point | mixture", choices=DIST_KINDS)
    median: float = field_doc(1000.0, "lognormal: median length (exp(mu))", gt=0, unit="tokens")
    sigma: float = field_doc(1.0, "lognormal: standard deviation of log-length", ge=0)
    value: float = field_doc(1000.0, "point: the single length", gt=0, unit="tokens")
    bins: list[list[float]] = field_doc(
        default_factory=list,
        doc="empirical: histogram rows [low, high, weight]; a length is drawn uniformly inside a row chosen by weight",
        unit="tokens",
    )
    components: list[LengthDistConfig] = field_doc(default_factory=list, doc="mixture: component distributions")
    weights: list[float] = field_doc(default_factory=list, doc="mixture: component weights (normalised)")

    def check(self, path: str) -> None:
        if self.kind == "empirical":
            if not self.bins:
                raise ConfigError(f"{path}.bins", "empirical distribution needs at least one [low, high, weight] row")
            for i, row in enumerate(self.bins):
                if len(row) != 3 or row[0] < 0 or row[1] < row[0] or row[2] < 0:
                    raise ConfigError(f"{path}.bins[{i}]", f"expected [low, high, weight] with 0 <= low <= high, weight >= 0, got {row}")
            if sum(r[2] for r in self.bins) <= 0:
                raise ConfigError(f"{path}.bins", "weights sum to zero")
        if self.kind == "mixture":
            if not self.components or len(self.components) != len(self.weights):
                raise ConfigError(f"{path}.weights", "mixture needs one weight per component (and >= 1 component)")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ConfigError(f"{path}.weights", "weights must be >= 0 with a positive sum")
            for i, comp in enumerate(self.components):
                comp.check(f"{path}.components[{i}]")


@dataclass
class WorkloadConfig:
    """What the rollout generates: prompt/response lengths per group, and their drift over steps."""

    prompt: LengthDistConfig = field(default_factory=lambda: LengthDistConfig(median=300.0, sigma=0.6))
    response: LengthDistConfig = field(default_factory=lambda: LengthDistConfig(median=1000.0, sigma=1.3))
    max_prompt_tokens: int = field_doc(2048, "prompt lengths are clipped to this", ge=1, unit="tokens")
    max_response_tokens: int = field_doc(30720, "response lengths are clipped to this (overlong truncation)", ge=1, unit="tokens")
    min_response_tokens: int = field_doc(1, "response lengths are raised to at least this", ge=1, unit="tokens")
    group_correlation: float = field_doc(
        0.3,
        "share of the log-length variance that is per prompt (shared by the G samples of a group); "
        "0 = samples independent, 1 = all samples of a group have the same length (lognormal only)",
        ge=0, le=1,
    )
    drift_per_step: float = field_doc(
        0.0,
        "response lengths of groups dispatched with version v are multiplied by (1 + drift_per_step)^v before "
        "clipping (RL on reasoning tasks lengthens responses over training)",
        ge=0,
    )
    seed: int = field_doc(0, "seed of the length stream; group k always gets the same lengths in every mode", ge=0)
    turns: LengthDistConfig = field_doc(
        default_factory=lambda: LengthDistConfig(kind="point", value=1.0),
        doc=("multi-turn workload: model turns per trajectory (drawn per sample, rounded, clipped to [1, max_turns] "
             "and to the response's tokens, which are split evenly over the turns); point 1 = single-turn. Between "
             "two turns the trajectory waits for a tool off the instance (no slot, no KV held) and comes back to "
             "the instance of its last turn"))
    max_turns: int = field_doc(8, "turns are clipped to this", ge=1)
    tool_latency_s: LengthDistConfig = field_doc(
        default_factory=lambda: LengthDistConfig(kind="point", value=1.0),
        doc=("multi-turn workload: seconds one tool call takes between two turns (the distribution's values are "
             "read as seconds; drawn per call)"))
    tool_result_tokens: int = field_doc(0, "tokens each tool result adds to the trajectory's context (prefilled at "
                                           "the next turn, trained as context, not generated)", ge=0, unit="tokens")

    @property
    def multi_turn(self) -> bool:
        """Whether the workload has trajectories of several turns (otherwise lengths are as single-turn)."""
        t = self.turns
        return not (t.kind == "point" and round(t.value) <= 1) and self.max_turns > 1


@dataclass
class SimClusterConfig:
    """Accelerators and how modes place trainer and rollout on them."""

    total_gpus: int = field_doc(64, "accelerators in the job (trainer + rollout)", ge=1)
    gpus_per_instance: int = field_doc(4, "accelerators per rollout instance (TP x PP, or one EP group for MoE)", ge=1)
    trainer_gpus: int = field_doc(32, "accelerators of the trainer under disaggregated placement; the rest serve rollout", ge=0)
    colocated_modes: list[str] = field_doc(
        default_factory=lambda: ["sync", "partial"],
        doc="modes run all-colocated (every accelerator alternates rollout and training, as in the paper's "
        "sync and partial baselines); the others are disaggregated",
    )
    elastic_colocation: bool = field_doc(
        False,
        "disaggregated modes: trainer accelerators serve rollout as extra instances while the trainer waits for "
        "data, and return (their requests migrate to rollout instances) when training starts",
    )

    def check(self, path: str) -> None:
        if self.trainer_gpus >= self.total_gpus:
            raise ConfigError(f"{path}.trainer_gpus", f"must leave rollout accelerators (< total_gpus={self.total_gpus})")
        if (self.total_gpus - self.trainer_gpus) < self.gpus_per_instance:
            raise ConfigError(f"{path}.gpus_per_instance", "no complete rollout instance fits beside the trainer")
        for i, m in enumerate(self.colocated_modes):
            if m not in ("sync", "one_step_off", "partial", "dora"):
                raise ConfigError(f"{path}.colocated_modes[{i}]", f"unknown mode {m!r}")

    def placement(self, mode: str) -> str:
        return "colocated" if mode in self.colocated_modes else "disaggregated"

    def rollout_instances(self, mode: str) -> int:
        gpus = self.total_gpus if self.placement(mode) == "colocated" else self.total_gpus - self.trainer_gpus
        return max(1, gpus // self.gpus_per_instance)

    def trainer_gpu_count(self, mode: str) -> int:
        return self.total_gpus if self.placement(mode) == "colocated" else self.trainer_gpus

    def elastic_instances(self, mode: str) -> int:
        if not self.elastic_colocation or self.placement(mode) == "colocated":
            return 0
        return self.trainer_gpus // self.gpus_per_instance


@dataclass
class SpecAcceptanceConfig:
    """Per-token draft acceptance probability (alpha) of each drafter, the simulator's model of speculation.

    WHY per drafter: drafts from a group's finished siblings answer the same prompt with the same
    weights and are accepted more often than drafts from the request's own text; the two are
    calibrated separately. Calibration points (``configs/sim/README.md``, "Speculative decoding"):
    DeepSeek-V3's MTP module reports 85-90% acceptance of its one draft token; the embedded
    engine's drafters on the main job's tiny model at temperature 1 measured 0.09-0.10 (where the
    engine's policy drafts nothing). The defaults are that published MTP figure's lower end: they
    stand for a model whose drafts agree, which the measured point is not.
    """

    ngram: float = field_doc(0.85, "rollout.speculative=ngram: probability that each draft token (from the "
                             "request's own prompt and output) is accepted, independently, until the first rejection",
                             ge=0, le=1)
    group: float = field_doc(0.85, "rollout.speculative=group: the same for drafts that also match the group's "
                             "finished sibling responses", ge=0, le=1)


@dataclass
class SimRolloutConfig:
    """The engine's speculative-decoding keys, under the same names as the job config's ``rollout:``.

    The decision to speculate is the engine's (:func:`dora_megatron.rollout.speculation.should_speculate`,
    then :func:`~dora_megatron.rollout.speculation.draft_length_for_step`); the simulator applies it
    to each instance's running batch between composition changes, with its own step cost unless
    ``spec_token_cost`` asks for the embedded engine's.
    """

    speculative: str = speculative_field()
    spec_tokens: int = spec_tokens_field()
    spec_max_batch: int = spec_max_batch_field()
    spec_token_cost: float | None = field_doc(
        None, "null (the default; --set rollout.spec_token_cost=null restores it): a draft length pays where the instance's own per-step cost model says so (a verify step of the "
        "batch's k+1 tokens per request against a decode step, cost.*); a number: the embedded engine's linear cost "
        "instead (rollout.spec_token_cost of the job config: each position of a step costs this much of a lone "
        "decode step)", ge=0.0)
    spec_probe_interval: int = spec_probe_interval_field()


@dataclass
class CostModelConfig:
    """Time and memory costs of one rollout instance and of the trainer (all per instance unless stated)."""

    # --- decode: memory-bound roofline per decode step ---
    decode_weight_read_s: float = field_doc(0.012, "per decode step: time to stream the instance's weight shard "
                                            "from HBM (weight bytes per GPU / HBM bandwidth)", ge=0, unit="s")
    decode_kv_read_s_per_token: float = field_doc(2.0e-8, "per decode step and resident context token: time to read "
                                                  "its KV (KV bytes per token per GPU / HBM bandwidth)", ge=0, unit="s/token")
    decode_compute_s_per_seq: float = field_doc(1.2e-4, "per decode step and running sequence: matmul time at peak "
                                                "(2 x params / (GPUs x peak FLOP/s)); the compute knee is where batch x "
                                                "this exceeds the memory time", ge=0, unit="s")
    decode_step_overhead_s: float = field_doc(0.004, "fixed per decode step (scheduler, launches, TP all-reduce latency)", ge=0, unit="s")
    # --- speculative decoding (rollout.speculative != off) ---
    spec_acceptance: SpecAcceptanceConfig = field(default_factory=SpecAcceptanceConfig)
    spec_verify_overhead_s: float = field_doc(0.0005, "per verify step, on top of the decode step of k+1 tokens per "
                                              "request: drafting (n-gram lookup) and the rejection sampling "
                                              "(assumed, not measured); it is what speculation costs when no "
                                              "draft is accepted", ge=0, unit="s")
    # --- prefill ---
    prefill_s_per_token: float = field_doc(2.0e-5, "prefill time per prompt token (compute-bound)", ge=0, unit="s/token")
    prefill_s_per_token2: float = field_doc(0.0, "quadratic (attention) prefill term per request: s x tokens^2", ge=0, unit="s/token^2")
    # --- memory ---
    max_concurrent: int = field_doc(64, "physical cap: requests an instance can hold in KV at once; extra requests queue", ge=1)
    kv_capacity_tokens: int = field_doc(400_000, "KV-cache capacity of one instance (reported as kv usage to the "
                                        "orchestrator)", ge=1, unit="tokens")
    kv_bytes_per_token: float = field_doc(262_144.0, "KV-cache bytes per token of one request (all layers, K and V)", gt=0, unit="bytes")
    host_kv_capacity_tokens: int = field_doc(0, "host-memory KV tier of one instance (the paper's KV offload): requests are "
                                             "admitted until device + host KV is full, the context beyond "
                                             "kv_capacity_tokens lives in host memory; 0 = no tier (admission stops at "
                                             "device KV)", ge=0, unit="tokens")
    host_kv_bandwidth_Bps: float = field_doc(1.0e11, "host <-> device bandwidth of one instance for spilled KV: every "
                                             "decode step streams the spilled tokens' KV over it (layer-wise, "
                                             "overlapped with the HBM reads), so a step takes at least spilled bytes / "
                                             "this", gt=0, unit="bytes/s")
    # --- weights ---
    weight_bytes: float = field_doc(65.5e9, "bytes of one full copy of the rollout weights", gt=0, unit="bytes")
    weight_sync_bandwidth_Bps: float = field_doc(50e9, "bandwidth at which one instance receives a new version "
                                                 "(trainer broadcast or snapshot load)", gt=0, unit="bytes/s")
    weight_sync_latency_s: float = field_doc(1.0, "fixed cost per version switch of an instance (setup, cache flush)", ge=0, unit="s")
    trainer_push_s: float = field_doc(2.0, "trainer time blocked per step pushing the new version out (disaggregated)", ge=0, unit="s")
    colocated_switch_s: float = field_doc(20.0, "colocated placement: time to swap roles (offload rollout / onload "
                                          "trainer, or back) per direction, per step", ge=0, unit="s")
    # --- migration ---
    migration_bandwidth_Bps: float = field_doc(25e9, "KV transfer bandwidth between two instances", gt=0, unit="bytes/s")
    migration_latency_s: float = field_doc(0.05, "fixed cost per migrated request (metadata RPC, block bookkeeping)", ge=0, unit="s")
    reprefill_on_migrate: bool = field_doc(False, "migrate by abort+resubmit (re-prefill prompt+partial on the "
                                           "destination, SGLang path) instead of KV transfer")
    # --- trainer ---
    train_flops_per_token: float = field_doc(2.56e11, "trainer FLOPs per consumed token (fwd+bwd+logprob recompute, "
                                             "e.g. 8 x params for dense)", gt=0, unit="FLOP/token")
    trainer_peak_flops_per_gpu: float = field_doc(9.89e14, "dense bf16 peak per accelerator", gt=0, unit="FLOP/s")
    trainer_mfu: float = field_doc(0.2, "model FLOPs utilisation of the trainer", gt=0, le=1)
    train_fixed_s: float = field_doc(30.0, "per-step fixed trainer time (experience maker setup, optimizer, barriers)", ge=0, unit="s")
    rebalance_overhead_s: float = field_doc(0.0, "fixed control-plane time of a rebalance that moves instances "
                                            "(pause, reassign, resume RPCs): each version switch and KV migration it "
                                            "orders starts that much later (the orchestrator's own CPU time is "
                                            "measured, not modelled)", ge=0, unit="s")

    def weight_sync_s(self) -> float:
        return self.weight_sync_latency_s + self.weight_bytes / self.weight_sync_bandwidth_Bps

    def train_s(self, tokens: int, gpus: int) -> float:
        return self.train_fixed_s + tokens * self.train_flops_per_token / (max(1, gpus) * self.trainer_peak_flops_per_gpu * self.trainer_mfu)


@dataclass
class SimRunConfig:
    """How long to simulate and what to record."""

    steps: int = field_doc(20, "training steps to simulate", ge=1)
    seed: int = field_doc(0, "seed of everything random in the simulator except the length stream", ge=0)
    warmup_steps: int = field_doc(0, "steps excluded from the steady-state rate metrics (throughput, step time, "
                                  "fractions); the paper averages 5 steps after warm-up", ge=0)
    timeline: bool = field_doc(True, "record per-instance (instance x time x version) intervals for the timeline plot")
    timeline_max_instances: int = field_doc(128, "instances drawn in the timeline plot (the first N)", ge=1)
    max_sim_time_s: float = field_doc(1e9, "stop the simulation after this much virtual time", gt=0, unit="s")
    poll_interval_s: float = field_doc(1.0, "virtual-time period of on_tick events to the orchestrator", gt=0, unit="s")
    stats_interval_s: float = field_doc(5.0, "virtual-time period of engine load reports (on_instance_stats, sent for "
                                        "instances over the KV watermark or with requests waiting for KV)", gt=0, unit="s")


@dataclass
class SimConfig:
    """Top-level simulator config (``dora simulate --config``)."""

    sim: SimRunConfig = field(default_factory=SimRunConfig)
    cluster: SimClusterConfig = field(default_factory=SimClusterConfig)
    cost: CostModelConfig = field(default_factory=CostModelConfig)
    rollout: SimRolloutConfig = field(default_factory=SimRolloutConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    orchestrator: dict[str, Any] = field_doc(
        default_factory=dict,
        doc="the production orchestrator section (dora_megatron.config.orchestrator.OrchestratorConfig), loaded "
        "strictly by the same loader",
    )

    def check(self, path: str) -> None:
        if self.sim.warmup_steps >= self.sim.steps:
            raise ConfigError(f"{path}.sim.warmup_steps" if path else "sim.warmup_steps",
                              f"{self.sim.warmup_steps} must be < sim.steps ({self.sim.steps}); "
                              f"set e.g. --set sim.warmup_steps={self.sim.steps - 1}")
        self.orchestrator_config()  # strict-load now so a typo fails at config time

    def orchestrator_config(self):  # -> OrchestratorConfig
        """The embedded ``orchestrator:`` mapping as the production dataclass (validated)."""
        from dora_megatron.config.loader import from_dict, validate
        from dora_megatron.config.orchestrator import OrchestratorConfig

        cfg = from_dict(OrchestratorConfig, self.orchestrator, "orchestrator")
        validate(cfg, "orchestrator")
        return cfg


def load_sim_config(path: str | Path | None = None, overrides: Iterable[str] = (), mode: str | None = None) -> SimConfig:
    """Load a sim YAML (or defaults), apply ``a.b=c`` overrides and ``--mode``, validate."""
    from dora_megatron.config.loader import apply_overrides, from_dict, read_yaml, validate

    overrides = list(overrides)
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides)
    _clamp_warmup(data, overrides)
    if mode is not None:
        data.setdefault("orchestrator", {})
        if not isinstance(data["orchestrator"], dict):
            raise ConfigError("orchestrator", "must be a mapping")
        data["orchestrator"]["mode"] = mode
    cfg = from_dict(SimConfig, data)
    validate(cfg)
    return cfg


def _clamp_warmup(data: dict, overrides: list[str]) -> None:
    """``--set sim.steps=N`` alone, below the file's ``warmup_steps``: keep at least one measured
    step (warm-up ``N - 1``) and say so, rather than refuse an override the user did not make.
    Both set explicitly and inconsistent stays an error (:meth:`SimConfig.check`)."""
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    run = data.get("sim")
    if "sim.steps" not in keys or "sim.warmup_steps" in keys or not isinstance(run, dict):
        return
    steps, warmup = run.get("steps"), run.get("warmup_steps")
    if isinstance(steps, int) and isinstance(warmup, int) and steps >= 1 and warmup >= steps:
        run["warmup_steps"] = steps - 1
        log.warning("sim.steps=%d: sim.warmup_steps lowered from %d to %d (one measured step at least)",
                    steps, warmup, steps - 1)
