"""``overview.png``: drawn from the rows the recorder writes to steps.jsonl and the run's summary,
with one panel per question (learning, speed, trainer wait, staleness, weight sync)."""

import json

import pytest

from dora_megatron.observability.overview import PANELS, overview_figure, read_steps, write_run_overview
from dora_megatron.observability.recorder import MetricsRecorder, StepsJsonl
from dora_megatron.observability.summary import RunTotals

STEPS = 60  # a rolling mean of 3 on top of the per-step values


def _run_dir(tmp_path, heldout=(0.25, 0.75)):
    """A run directory as ``dora train`` leaves it: steps.jsonl from the recorder, summary.json."""
    with open(tmp_path / "steps.jsonl", "w") as f:
        rec = MetricsRecorder(slots_per_instance=2, rebalancer=True, sinks=[StepsJsonl(f)])
        rec.instance_joined("a", 0.0)
        rec.instance_joined("b", 0.0)
        for k in range(STEPS):
            t = 10.0 * k
            rec.weight_sync_started("ab"[k % 2], t + 1, rebalance=k % 3 == 0)
            rec.weight_sync_finished("ab"[k % 2], t + 3)
            rec.request_held_slot(t, t + 7)
            rec.step_trained(k, end_s=t + 10, wait_s=4.0 if k < 5 else 1.0, train_s=5.0, tokens=200,
                             staleness=[0, 1] if k % 2 else [1, 1], rewards=[1.0] * (k // 10) + [0.0] * 3,
                             response_lengths=[5, 9], live_versions=1 + k % 2, migrations=k)
    summary = rec.summary(mode="dora", max_staleness=1, tbs=2, rbs=4, wall_time_s=10.0 * STEPS,
                          totals=RunTotals(dispatched_groups=2 * STEPS, consumed_groups=2 * STEPS))
    summary["heldout_exact_initial"], summary["heldout_exact_final"] = heldout
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return summary


def _axis(fig, title):
    return next(ax for ax in fig.axes if ax.get_title().split("\n")[0] == title)


def test_the_overview_of_a_recorded_run_has_every_panel(tmp_path):
    summary = _run_dir(tmp_path)
    rows = read_steps(tmp_path / "steps.jsonl")
    fig = overview_figure(rows, summary, title="dora: run overview")
    assert [ax.get_title().split("\n")[0] for ax in fig.axes] == list(PANELS)
    reward = _axis(fig, PANELS[0])
    heldout = next(line for line in reward.lines if line.get_label().startswith("held-out"))
    assert list(heldout.get_xdata()) == [0, STEPS - 1] and list(heldout.get_ydata()) == [0.25, 0.75]
    # the reward rises with the rows (k // 10 exact of k // 10 + 3 samples): its rolling mean ends at 5/8
    mean = next(line for line in reward.lines if line.get_label().startswith("reward mean ("))
    assert mean.get_ydata()[-1] == pytest.approx(5 / 8) and mean.get_label() == "reward mean (mean of 3)"
    # the staleness histogram is the summary's (share of every consumed group)
    bars = _axis(fig, PANELS[3]).patches
    hist = summary["staleness_histogram"]
    total = sum(hist.values())
    assert [b.get_height() for b in bars] == pytest.approx([v / total for v in hist.values()])
    # live versions as the rows say; the run's weight sync share in the panel's title
    live = next(line for line in _axis(fig, PANELS[4]).lines if line.get_label() == "live versions")
    assert list(live.get_ydata()) == [1.0 + k % 2 for k in range(STEPS)]
    sync_title = _axis(fig, PANELS[5]).get_title()
    assert f"weight sync {100 * summary['weight_sync_fraction']:.1f}%" in sync_title and "migrations 59" in sync_title
    wait = next(line for line in _axis(fig, PANELS[2]).lines if line.get_label().startswith("trainer wait share of"))
    assert max(wait.get_ydata()) == pytest.approx(0.4)  # 4 s of a 10 s step, the first steps


def test_write_run_overview_writes_a_png(tmp_path):
    _run_dir(tmp_path)
    path = write_run_overview(tmp_path, title="dora")
    assert path == tmp_path / "overview.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_steps_no_overview_and_a_bad_row_names_its_line(tmp_path):
    assert write_run_overview(tmp_path) is None
    (tmp_path / "steps.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match="steps.jsonl:2"):
        read_steps(tmp_path / "steps.jsonl")
    with pytest.raises(ValueError, match="no step rows"):
        overview_figure([])


def test_a_simulated_run_without_rewards_still_draws(tmp_path):
    summary = _run_dir(tmp_path, heldout=(None, None))
    rows = [{**r, "reward/mean": None, "reward/exact_fraction": None} for r in read_steps(tmp_path / "steps.jsonl")]
    fig = overview_figure(rows, summary)
    assert not _axis(fig, PANELS[0]).lines
    assert [t.get_text() for t in _axis(fig, PANELS[0]).texts] == ["no rewards (simulated run)"]
