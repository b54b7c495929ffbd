"""Logging, metrics and trace outputs of a run."""

from __future__ import annotations

from dataclasses import dataclass

from dora_megatron.config.base import field_doc


@dataclass
class ObservabilityConfig:
    log_level: str = field_doc("INFO", "Python logging level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    tensorboard: bool = field_doc(True, "Write TensorBoard scalars to `<run_dir>/tb`.")
    wandb: bool = field_doc(False, "Also log the step scalars to Weights & Biases (`pip install -e '.[wandb]'`), in `<run_dir>/wandb`: online when `WANDB_MODE` says so or this machine has W&B credentials, else offline (`wandb sync` later).")
    wandb_project: str = field_doc("dora", "W&B project of `observability.wandb`.")
    timeline: bool = field_doc(True, "Write `timeline.png` and `trace.json` (Chrome trace, opens in Perfetto).")
    timeline_window_steps: int = field_doc(6, "Trainer steps drawn in detail in `timeline.png` (each version its own labelled colour, instances as rows, the trainer's steps, weight loads and migrations): the steady-state steps around the middle of the run (after `observability.warmup_steps` and the first step); every step when the run has no more. Below it the whole run is drawn by version age at any length.", ge=1)
    overview: bool = field_doc(True, "Write `overview.png` at each checkpoint (on a background thread, off the controller's event loop) and at the end of the run: reward and held-out exact rate, tokens/s, trainer wait and rollout utilisation, staleness and live versions, weight sync and rebalance, drawn from `steps.jsonl` and `summary.json` (`dora simulate` writes the same figure next to its output).")
    progress: bool = field_doc(True, "Show a progress bar on stderr.")
    stats_interval_s: float = field_doc(0.5, "How often the controller polls engine load (seconds).", gt=0.0)
    heldout_prompts: int = field_doc(0, "Digit tasks: after the run, answer this many held-out prompts with the initial and the final weights (sampled as the rollout samples: its temperature, top-p, top-k and stop tokens) and write `heldout.json` and `summary.json` fields `heldout_exact_initial` / `heldout_exact_final`; 0 = off.", ge=0)
    heldout_greedy: bool = field_doc(False, "Also evaluate the held-out prompts with greedy decoding.")
    warmup_steps: int = field_doc(0, "Steps excluded from the run's rate metrics in `summary.json` (throughput, step time, rollout-only fraction, utilization, sync fractions): the first step waits for a whole first rollout, which a steady-state comparison (e.g. against `dora bench`'s capacities) should not count; as `sim.warmup_steps` in the simulator. Must be < run.steps.", ge=0)
    eval_interval: int = field_doc(0, "Eval set (`data.eval_path`): evaluate the weights of every this many steps on the rollout engines, beside the training (its requests share the engines with the rollout, the trainer does not wait for them), and always the final weights at the end; 0 = only at the end.", ge=0)
    eval_samples: int = field_doc(4, "Eval set: samples per prompt, drawn as the rollout samples (its temperature, top-p, top-k and stop tokens); the k of the reported pass@k (pass@1 and pass@k by the unbiased estimator of Chen et al. 2021).", ge=1)
    eval_pass_threshold: float = field_doc(1.0, "Eval set: a sample passes (pass@1, pass@k) when its reward is at least this (1.0: a 0/1 or a -1/1 reward's correct answers).")
    dump_rollouts: int = field_doc(0, "Write this many of each step's trained samples to `<run_dir>/rollouts/step_XXXXXX.jsonl` (one JSON object per sample: `prompt_text` as rendered for the model, special tokens kept, `prompt_ids`, `response_text` decoded as the reward sees it, `response_ids`, `reward`, `reward_error` when the reward function failed, `version`, `finish_reason`, `group_id`, `sample_id`, `step`), one sample of each group first; 0 = off.", ge=0)
