"""GRPO-family advantages and policy losses as pure torch functions.

Kept import-light: import :mod:`dora_megatron.algo.advantages` / :mod:`dora_megatron.algo.losses`
explicitly (they import torch)."""

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std")
POLICY_LOSSES = ("ppo_clip", "triplet_clip")
