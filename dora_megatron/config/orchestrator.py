"""Orchestrator section: rollout mode, batch sizes, staleness window and rebalancer thresholds.

WHY: the orchestrator (DESIGN sections 2-4) is one sans-IO state machine whose four modes are
policies; every number that shapes its decisions lives here, documented, so the runtime, the
simulator and the benchmark all run the same policy from the same YAML.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import ConfigError, field_doc

MODES = ("sync", "one_step_off", "partial", "dora")


@dataclass
class OrchestratorConfig:
    """Rollout orchestration policy (DESIGN sections 2-4)."""

    mode: str = field_doc("dora", "rollout mode: sync | one_step_off | partial | dora (DESIGN section 3)",
                          choices=MODES)
    tbs: int = field_doc(8, "training batch size: groups consumed by every training step (exact)", ge=1)
    rbs: int = field_doc(16, "rollout batch size: cap on outstanding groups (dispatched, not yet consumed); "
                         "streaming modes only, sync/one_step_off use tbs", ge=1)
    max_staleness: int = field_doc(1, "S: a group of version w may be trained in step t only if t - w <= S; up to "
                                   "S+1 versions live (paper k=3 runs use S=3). Used by partial and dora; sync "
                                   "forces 0 and one_step_off forces 1", ge=0)
    group_size: int = field_doc(4, "G: samples per prompt group (GRPO group)", ge=1)
    kv_high_watermark: float = field_doc(0.9, "KV-cache usage fraction above which an instance triggers a "
                                         "rebalance (dora)", gt=0, le=1)
    kv_rebalance_min_interval_s: float = field_doc(1.0, "rate limit of the KV-watermark trigger: a full "
                                                   "rebalance triggered by KV usage runs at most once per "
                                                   "this many seconds of driver time (the intra-version "
                                                   "leveling of the hot instance still runs every time); "
                                                   "0 = no limit", ge=0, unit="s")
    rebalance_interval_s: float = field_doc(5.0, "timer trigger: rebalance at least this often while work is "
                                            "in flight (dora), seconds; 0 disables the timer", ge=0, unit="s")
    imbalance_ratio: float = field_doc(1.5, "hysteresis: a partition that neither fixes a stranded version nor "
                                       "frees an idle instance is applied only if max/min per-instance load "
                                       "across versions exceeds this ratio", ge=1)
    repartition: bool = field_doc(True, "dora only: run the rebalancer (partition, migration). False is the "
                                  "ablation where an instance moves to the newest version only once drained")
    legacy_fill: bool = field_doc(False, "tier-2: let idle slots of legacy-version instances take new groups of "
                                  "that version when the admission rule allows (dora)")
    max_migrations_per_rebalance: int = field_doc(4096, "bound on requests moved by one rebalance (KV transfer "
                                                  "budget); instances whose requests do not fit stay for a "
                                                  "later cycle (keeps a rebalance at 4,096 instances / 100k requests under 100 ms). 0 = unlimited (the paper's behaviour)", ge=0)
    free_into_room: bool = field_doc(False, "minimum gain of a move: a rebalance frees an instance only when its "
                                     "requests fit under the cap of the instances its version keeps (none then "
                                     "waits at its destination for a running slot it had at its source); "
                                     "otherwise the instance stays until they fit. Not applied while some "
                                     "version has queued requests (failure recovery)")
    dual_version: bool = field_doc(False, "dora: when the newest version has admissible groups but no instance, "
                                   "switch an instance that still runs an older version's requests to the newest "
                                   "one at once; it keeps the old weights for those requests (a second weight "
                                   "set), takes no new work of the old version, and "
                                   "drops the old weights when they drain. Simulator only (dora simulate): no engine "
                                   "keeps a second weight set yet")
    cap_before_rebalance: int = field_doc(8, "per-instance concurrency cap (running samples) before the first "
                                          "non-update rebalance of a step (streaming modes)", ge=1)
    cap_after_rebalance: int = field_doc(4, "per-instance concurrency cap after the first non-update rebalance "
                                         "of a step (streaming modes)", ge=1)

    def check(self, path: str) -> None:
        if self.rbs < self.tbs:
            raise ConfigError(f"{path}.rbs", f"must be >= tbs ({self.tbs}), got {self.rbs}")
        if self.cap_after_rebalance > self.cap_before_rebalance:
            raise ConfigError(f"{path}.cap_after_rebalance",
                              f"must be <= cap_before_rebalance ({self.cap_before_rebalance})")

    @property
    def effective_staleness(self) -> int:
        """S actually enforced: sync is on-policy (0), one_step_off is one step behind (1)."""
        if self.mode == "sync":
            return 0
        if self.mode == "one_step_off":
            return 1
        return self.max_staleness

    @property
    def effective_rbs(self) -> int:
        """Outstanding-group cap actually enforced: the barrier modes keep exactly one batch out."""
        return self.tbs if self.mode in ("sync", "one_step_off") else self.rbs
