"""``dora bench``: which variants run side by side, and how often."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc

#: Variant name -> (orchestrator/launch overrides); see dora_megatron.launch.bench.VARIANTS.
VARIANT_NAMES = ("sync_colocated", "sync", "one_step_off", "partial", "dora", "dora_s1", "dora_s3",
                 "dora_no_repartition", "dora_reprefill", "dora_s3_reprefill", "dora_legacy_fill",
                 "dora_one_cap", "dora_embedded", "dora_vllm")
#: Rollout engines ``bench.engines`` may list (the choices of ``rollout.engine``).
ENGINE_NAMES = ("embedded", "sglang", "vllm")


@dataclass
class BenchConfig:
    variants: list[str] = field_doc(
        default_factory=lambda: ["sync_colocated", "sync", "one_step_off", "partial", "dora_s1", "dora_s3"],
        doc="Variants to run, in order: " + ", ".join(VARIANT_NAMES) + ". `sync_colocated` lets every phase use "
            "all cores; the others pin engines and trainer to their own cores. `dora` uses the configured "
            "max_staleness, `dora_s1`/`dora_s3` set it; the other `dora_*` variants are ablations that switch one DORA "
            "mechanism off (compare them with `dora`); `dora_embedded`/`dora_vllm` run the same DORA workload on each rollout engine. `VARIANT@ENGINE` runs "
            "the variant on that engine only (e.g. `dora_s3_reprefill@embedded`, the KV-less pair of `dora_s3`, with "
            "`engines: [embedded, sglang]`).")
    engines: list[str] = field_doc(
        default_factory=list,
        doc="Rollout engines every variant runs on, side by side in one run (" + ", ".join(ENGINE_NAMES) + "); "
            "empty: `rollout.engine` as configured. With engines listed, runs are named `VARIANT@ENGINE`, each "
            "engine's runs get their own ratios and a paired ratio of each variant's throughput on every engine "
            "against the first listed; engines are started as the train job starts them (the `sglang:`/`vllm:` "
            "sections and `rollout.sglang_args` act on their engine only).")
    seeds: int = field_doc(1, "Runs per variant with different run seeds (reward and load noise); run seed-major: "
                              "every variant's seed k before any variant's seed k+1.", ge=1)
    limits: bool = field_doc(True, "Before each seed round, measure rollout capacity (the engines alone at full "
                                   "concurrency) and training capacity (the trainer alone on batches recorded from "
                                   "that rollout) on the disaggregated cores; each variant's `efficiency` is its "
                                   "throughput / min(the two).")
    limit_steps: int = field_doc(5, "Recorded training batches the trainer-alone measurement times (the first is "
                                    "warm-up, not counted); the rollout pass generates at least their groups.", ge=2)
    baseline: str = field_doc("auto", "Sync baseline of the ratios: `auto` = the faster of sync and sync_colocated.")
    ci_level: float = field_doc(0.95, "Confidence level of each ratio's interval (DORA / sync, / one_step_off, "
                                      "/ partial): a Student t interval over the rounds' log throughput ratios, "
                                      "paired by round (needs `seeds` >= 2).", gt=0.0, lt=1.0)
    reward_level: float = field_doc(0.5, "Time-to-reward: the wall time (sum of step times) at which a run's "
                                         "trailing `reward_window`-step mean reward of its trained samples first "
                                         "reaches this level; per variant the seeds' times and how many got there.")
    reward_window: int = field_doc(5, "Steps of the trailing mean of time-to-reward (one step's few groups are "
                                      "too noisy to compare).", ge=1)
    reward_source: str = field_doc("trained", "What time-to-reward reads: `trained` = the reward of each step's "
                                              "trained samples (`steps.jsonl`, over `reward_window` steps); `eval` = "
                                              "the held-out eval set's rounds (`eval.jsonl`: the mean reward of the "
                                              "weights of the round's step on `data.eval_path`, every "
                                              "`observability.eval_interval` steps; a round is not smoothed). `eval` "
                                              "needs both keys set; its requests share the engines with the rollout "
                                              "in every variant.", choices=("trained", "eval"))

    def check(self, path: str) -> None:
        for i, engine in enumerate(self.engines):
            if engine not in ENGINE_NAMES:
                raise ConfigError(f"{path}.engines[{i}]", f"unknown engine {engine!r}; valid: {', '.join(ENGINE_NAMES)}")
        if len(set(self.engines)) != len(self.engines):
            raise ConfigError(f"{path}.engines", f"lists an engine twice: {self.engines}")
        for i, entry in enumerate(self.variants):
            name, _, engine = entry.partition("@")  # VARIANT@ENGINE: that engine only
            if engine and engine not in ENGINE_NAMES:
                raise ConfigError(f"{path}.variants[{i}]", f"unknown engine {engine!r} in {entry!r}; valid: {', '.join(ENGINE_NAMES)}")
            if engine and self.engines and engine not in self.engines:
                raise ConfigError(f"{path}.variants[{i}]", f"{entry!r} names an engine that bench.engines does not list ({self.engines})")
            if name not in VARIANT_NAMES:
                raise ConfigError(f"{path}.variants[{i}]", f"unknown variant {name!r}; valid: {', '.join(VARIANT_NAMES)}")
        if not self.variants:
            raise ConfigError(f"{path}.variants", "must name at least one variant")
