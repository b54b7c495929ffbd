"""TensorBoard scalars, behind a tiny interface so tests and the simulator can swap it.

Uses the ``tensorboard`` package's own event writer through torch's
``SummaryWriter`` (imported lazily); ``NullWriter`` keeps call sites branch-free
when TensorBoard is off.

Every event directory also gets :data:`DORA_LAYOUT`, a layout of TensorBoard's own
``custom_scalar`` plugin (the CUSTOM SCALARS tab): the run's tags grouped as the story of an
asynchronous RL run -- is it learning, how fast, does the trainer wait, how stale are the
samples, what weight sync costs -- rather than in the alphabetical groups of the SCALARS tab.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Mapping, Protocol, Sequence

from dora_megatron.observability.eval_metrics import EVAL_TAGS


#: the held-out exact-answer rate (sampled decoding), written after the run by :func:`write_heldout`
HELDOUT_TAG = "heldout/exact"

#: The CUSTOM SCALARS layout: category -> chart -> the exact step tags it plots (see
#: ``observability.recorder.METRICS`` for what each tag means). Each chart draws its tags as lines
#: on shared axes, so a chart only groups tags of one unit. Tags a mode does not write (no
#: rebalancer: ``perf/rebalance_time_s``) leave their line empty.
DORA_LAYOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "1 reward and held-out": {
        "reward: mean and exact-answer share of the step's samples": ("reward/mean", "reward/exact_fraction"),
        "reward function failures: samples of the step scored 0 for an error": ("reward/errors",),
        "held-out exact rate: initial weights (step 0), final weights (last version)": (HELDOUT_TAG,),
        "eval set (data.eval_path): mean reward, pass@1, pass@k of the weights of the step": tuple(EVAL_TAGS.values()),
    },
    "2 throughput": {
        "tokens/s: the run so far (prompt+response tokens / wall seconds)": ("perf/throughput_tokens_per_s",),
        "tokens/s: the trainer's own step": ("perf/trainer_tokens_per_s",),
    },
    "3 trainer wait and rollout utilisation": {
        "shares so far: trainer waiting for its batch, busy rollout slots": (
            "perf/rollout_only_fraction", "perf/rollout_utilization"),
        "seconds per step: step, wait, train, trainer-side sync": (
            "perf/step_time_s", "perf/wait_time_s", "perf/train_time_s", "perf/sync_time_s"),
    },
    "4 staleness and live versions": {
        "staleness t - w of the step's groups (mean, max)": ("staleness/mean", "staleness/max"),
        "weight versions live when the step ended": ("versions/live",),
    },
    "5 weight sync, rebalance and migrations": {
        "instance-seconds of weight loads in the step (all, by rebalance)": (
            "perf/weight_sync_time_s", "perf/rebalance_time_s"),
        "request migrations so far": ("migrations/count",),
        "migrated KV bytes so far": ("migrations/kv_bytes",),
        "re-prefilled tokens so far": ("migrations/reprefill_tokens",),
    },
    "6 multi-turn trajectories and tools": {
        "share of the step's trajectories that called a tool": ("env/tool_use_rate",),
        "model turns per trajectory": ("env/turns_per_trajectory",),
        "model tokens per turn": ("env/tokens_per_turn",),
        "seconds per tool call": ("env/tool_latency_s",),
        "tool calls that failed (all errors, timeouts)": ("env/tool_errors", "env/tool_timeouts"),
    },
}


def custom_scalars_layout(layout: Mapping[str, Mapping[str, Sequence[str]]] = DORA_LAYOUT) -> dict:
    """``layout`` in the form ``SummaryWriter.add_custom_scalars`` takes: multiline charts whose
    tags are anchored regular expressions, so each chart plots exactly its tags (the plugin
    matches tags by regex: ``staleness/max`` alone would also match a longer tag)."""
    return {category: {chart: ["Multiline", [f"^{re.escape(t)}$" for t in tags]] for chart, tags in charts.items()}
            for category, charts in layout.items()}


class ScalarWriter(Protocol):
    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardWriter:
    """``purge_step``: a resumed run re-does the steps from its checkpoint on; TensorBoard then
    hides the crashed lineage's scalars at steps >= ``purge_step``, so each step shows once."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(logdir), purge_step=purge_step)
        # once per event file (the plugin reads it from any file of the run; a resumed run writes it again)
        self._writer.add_custom_scalars(custom_scalars_layout())

    def scalars(self, step: int, values: Mapping[str, float | int | None]) -> None:
        for tag, value in values.items():
            if value is None:
                continue
            self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def write_heldout(logdir: str | Path, initial: float, final: float, final_version: int) -> None:
    """The held-out rates as two points of :data:`HELDOUT_TAG`: the initial weights at step 0 and
    the final ones at the step of their version, so they sit on the reward charts' step axis."""
    writer = TensorBoardWriter(logdir)
    try:
        writer.scalars(0, {HELDOUT_TAG: initial})
        writer.scalars(final_version, {HELDOUT_TAG: final})
    finally:
        writer.close()
