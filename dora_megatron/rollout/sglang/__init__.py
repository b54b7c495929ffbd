"""rollout/sglang package."""
