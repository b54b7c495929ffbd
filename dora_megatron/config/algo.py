"""Algorithm section: advantage estimator and GRPO-family loss knobs.

WHY: the loss is a pure function of tensors plus these settings; keeping them in one typed section
lets the trainer, the docs and the tests agree on names and defaults (DESIGN section 7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_megatron.config.base import ConfigError, field_doc


@dataclass
class AlgoConfig:
    """GRPO-family objective settings."""

    # keys that existed once and could not act: {key: (old default, why)}; see loader.from_dict
    REMOVED_KEYS: ClassVar[dict[str, tuple[Any, str]]] = {
        "kl_coef": (0.0, "dora runs no reference model (no sample carries reference log-probs), so there is no "
                         "KL penalty; delete the key"),
    }

    advantage_estimator: str = field_doc("grpo", "advantage estimator name (see dora_megatron.algo.ADVANTAGE_ESTIMATORS)",
                                         choices=("grpo", "grpo_no_std"))
    adv_eps: float = field_doc(1e-6, "added to the group std before dividing", ge=0)
    loss: str = field_doc("ppo_clip", "policy loss name (see dora_megatron.algo.POLICY_LOSSES)",
                          choices=("ppo_clip", "triplet_clip"))
    clip_eps_low: float = field_doc(0.2, "PPO ratio lower clip: ratio >= 1 - clip_eps_low", ge=0)
    clip_eps_high: float = field_doc(0.2, "PPO ratio upper clip: ratio <= 1 + clip_eps_high", ge=0)
    triplet_neg_low: float = field_doc(0.2, "triplet clip: lower eps for negative advantages", ge=0)
    triplet_neg_high: float = field_doc(0.28, "triplet clip: upper eps for negative advantages", ge=0)
    triplet_pos_low: float = field_doc(0.2, "triplet clip: lower eps for positive advantages", ge=0)
    triplet_pos_high: float = field_doc(0.28, "triplet clip: upper eps for positive advantages", ge=0)
    dual_clip_c: float = field_doc(3.0, "dual-clip bound for negative advantages (loss <= c*|A|); 0 disables",
                                   ge=0)
    tis_cap: float = field_doc(0.0, "truncated importance-sampling cap on exp(trainer_lp - rollout_lp); 0 disables",
                               ge=0)
    rollout_correction: str = field_doc(
        "none", "rollout correction on r = exp(trainer_lp - rollout_lp): token_mis / seq_mis drop tokens / samples "
        "whose ratio (seq: see seq_mis_agg) leaves [correction_low, correction_high] from the loss; icepop weights "
        "kept tokens by r and zeroes the rest (see dora_megatron.algo.correction); composes with tis_cap",
        choices=("none", "token_mis", "seq_mis", "icepop"))
    correction_low: float = field_doc(0.5, "lower bound of the rollout_correction ratio band", gt=0)
    correction_high: float = field_doc(2.0, "upper bound of the rollout_correction ratio band", gt=0)
    seq_mis_agg: str = field_doc("geometric", "seq_mis sample ratio: geometric (exp of the mean log-ratio) or "
                                 "product (exp of the sum)", choices=("geometric", "product"))
    routing_replay: bool = field_doc(
        False, "MoE routing replay (R3): engines are asked for return_routed_experts (SGLang: "
        "--enable-return-routed-experts) and every trainer MoE router uses the engine's top-k experts for "
        "each token (Megatron RouterReplay)")
    router_agreement: bool = field_doc(
        False, "ask engines for routed experts and log router_topk_agreement (trainer top-k vs engine top-k, before "
        "replay) without replaying; implied by routing_replay")
    length_norm: str = field_doc("token_mean", "token_mean (sum/total tokens), seq_mean (per-sample mean) or "
                                 "constant (Dr.GRPO: sum / (num_samples * length_norm_constant))",
                                 choices=("token_mean", "seq_mean", "constant"))
    length_norm_constant: int = field_doc(0, "divisor per sample for length_norm=constant, tokens (set it to the "
                                          "rollout max_new_tokens); required > 0 with length_norm=constant", ge=0)
    entropy_coef: float = field_doc(0.0, "entropy bonus coefficient (entropy is always logged)", ge=0)

    @property
    def wants_routed_experts(self) -> bool:
        """Engines must return routed experts (SGLang: started with --enable-return-routed-experts)."""
        return self.routing_replay or self.router_agreement

    def check(self, path: str) -> None:
        if self.clip_eps_low >= 1:
            raise ConfigError(f"{path}.clip_eps_low", "must be < 1 (ratio lower bound would be <= 0)")
        if self.length_norm == "constant" and self.length_norm_constant <= 0:
            raise ConfigError(f"{path}.length_norm_constant", "must be > 0 when length_norm is constant")
        if not self.correction_low <= 1.0 <= self.correction_high:
            raise ConfigError(f"{path}.correction_low", f"the band [{self.correction_low}, {self.correction_high}] "
                              "must contain 1 (on-policy tokens would be dropped)")
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError(f"{path}.dual_clip_c", "must be > 1 (or 0 to disable)")
