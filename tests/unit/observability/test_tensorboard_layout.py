"""The CUSTOM SCALARS layout: written with the events, read back as TensorBoard's plugin reads it,
and every chart names tags the run really writes (the recorder's rows, the held-out points, the
eval set's rounds)."""

import re

import pytest

from dora_megatron.observability.eval_metrics import EVAL_TAGS, eval_scalars, round_metrics
from dora_megatron.observability.recorder import STEP_KEYS, MetricsRecorder
from dora_megatron.observability.trajectories import TrajectoryStats
from dora_megatron.observability.tensorboard import DORA_LAYOUT, HELDOUT_TAG, TensorBoardWriter, write_heldout
from tests.helpers.tensorboard_read import read_layout, read_scalar_tags


def _run(logdir, steps=3):
    writer = TensorBoardWriter(logdir)
    rec = MetricsRecorder(slots_per_instance=2, rebalancer=True, sinks=[writer])
    rec.instance_joined("a", 0.0)
    for k in range(steps):
        rec.weight_sync_started("a", 10.0 * k + 1, rebalance=k % 2 == 1)
        rec.weight_sync_finished("a", 10.0 * k + 2)
        rec.request_held_slot(10.0 * k, 10.0 * k + 8)
        rec.trajectory_finished(TrajectoryStats(turns=2, model_tokens=12, tool_calls=1, well_formed_calls=1,
                                                tool_latency_s=0.5))
        rec.step_trained(k, end_s=10.0 * (k + 1), wait_s=1.0, train_s=2.0, tokens=100, staleness=[0, 1],
                         rewards=[1.0, 0.0], response_lengths=[5, 9], live_versions=2,
                         metrics={"perf/trainer_tokens_per_s": 50.0, "loss": 0.1}, migrations=k,
                         reward_errors=k % 2)
    writer.scalars(steps - 1, eval_scalars(round_metrics([[1.0, 0.0]], 2, 1.0)))  # as an eval round writes them
    writer.close()
    write_heldout(logdir, 0.2, 0.6, steps)


def test_the_layout_is_in_the_event_file_and_plots_only_written_tags(tmp_path):
    _run(tmp_path)
    layout = read_layout(tmp_path)
    assert list(layout) == list(DORA_LAYOUT)  # the categories in story order
    written = read_scalar_tags(tmp_path)
    for category, charts in DORA_LAYOUT.items():
        assert list(layout[category]) == list(charts)
        for chart, tags in charts.items():
            patterns = layout[category][chart]
            assert len(patterns) == len(tags)
            for pattern, tag in zip(patterns, tags):
                # each regex selects exactly its own tag among everything the run wrote
                assert [t for t in written if re.search(pattern, t)] == [tag], (chart, pattern)
                assert tag in STEP_KEYS or tag == HELDOUT_TAG or tag in EVAL_TAGS.values()
    assert [s for s, _ in written[HELDOUT_TAG]] == [0, 3]
    assert [v for _, v in written[HELDOUT_TAG]] == pytest.approx([0.2, 0.6])


def test_the_layout_covers_the_dora_story():
    plotted = {t for charts in DORA_LAYOUT.values() for tags in charts.values() for t in tags}
    for tag in ("reward/mean", "perf/throughput_tokens_per_s", "perf/rollout_only_fraction",
                "perf/rollout_utilization", "staleness/mean", "versions/live", "perf/weight_sync_time_s",
                "perf/rebalance_time_s", "migrations/count", HELDOUT_TAG):
        assert tag in plotted
    assert not plotted - set(STEP_KEYS) - {HELDOUT_TAG} - set(EVAL_TAGS.values())
    assert set(EVAL_TAGS.values()) <= plotted


def test_a_resumed_writer_keeps_one_layout(tmp_path):
    _run(tmp_path)
    TensorBoardWriter(tmp_path, purge_step=2).close()  # a resumed run opens a second event file
    assert list(read_layout(tmp_path)) == list(DORA_LAYOUT)
