"""The non-interactive progress lines of `dora train` carry step, reward, versions, throughput and an ETA."""

from __future__ import annotations

import logging

from dora_megatron.controller.outputs import Progress, clock


def test_clock_format():
    assert clock(0) == "0:00"
    assert clock(754.2) == "12:34"
    assert clock(3725) == "1:02:05"


def test_progress_line_has_eta(caplog):
    progress = Progress(total=4, enabled=False)
    with caplog.at_level(logging.INFO, logger="dora_megatron.controller.outputs"):
        progress.update(0, {"reward/mean": 0.5, "versions/live": 2, "perf/throughput_tokens_per_s": 100.0})
        progress.update(3, {"reward/mean": 0.75, "versions/live": 1, "perf/throughput_tokens_per_s": 90.0})
    first, last = caplog.messages
    assert first.startswith("step 1/4 reward=0.500 live_versions=2 tok/s=100 eta=")
    assert last.endswith("eta=0:00")  # the last step leaves nothing to do
