"""`dora train` end to end on real processes: engines over HTTP, torchrun trainer, controller.

A shortened main job (few steps, a short warm start) must finish with every
DESIGN section 11 summary field, zero lost/duplicated groups, zero C1/C3
violations, TensorBoard tags, the timeline PNG and the Chrome trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dora_megatron.observability.summary import SUMMARY_FIELDS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run_train(tmp_path: Path, *overrides: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dora_megatron", "train", "--config", str(ROOT / "configs" / "cpu_tiny.yaml"),
           "--set", f"run.run_dir={run_dir}", "--set", "observability.progress=false", *[x for o in overrides for x in ("--set", o)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, run_dir


def test_short_dora_run(tmp_path):
    proc, run_dir = run_train(tmp_path, "run.steps=4", "model.warm_start_steps=10", "orchestrator.tbs=4",
                              "orchestrator.rbs=8", "orchestrator.max_staleness=1",
                              "orchestrator.group_size=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run directory: {run_dir}" in proc.stderr + proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in SUMMARY_FIELDS:
        assert key in summary, key
    assert summary["mode"] == "dora" and summary["steps"] == 4 and summary["tbs"] == 4
    assert summary["consumed_groups"] == 16
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    assert summary["max_consumed_staleness"] <= 1
    assert summary["throughput_tokens_per_s"] > 0
    assert 0 <= summary["rollout_only_fraction"] <= 1
    # TensorBoard scalars
    from dora_megatron.observability.tensorboard import read_scalar_tags

    tags = read_scalar_tags(run_dir / "tb")
    for tag in ("reward/mean", "response_length/p50", "response_length/p99", "perf/throughput_tokens_per_s",
                "perf/step_time_s", "perf/rollout_only_fraction", "perf/rollout_utilization", "staleness/mean",
                "versions/live", "migrations/count", "perf/weight_sync_time_s", "train/loss", "train/clip_fraction",
                "train/rollout_vs_trainer_logprob_diff"):
        assert tag in tags, (tag, sorted(tags))
        assert len(tags[tag]) == 4
    # on-policy first step: the trainer recomputes exactly the engine's log-probs (fp32 CPU)
    assert tags["train/rollout_vs_trainer_logprob_diff"][0][1] < 1e-4
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e.get("name") == "step 0" for e in trace["traceEvents"])
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "weights" / "v000004" / "model.safetensors").is_file()
    # every child process is gone
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert out.stdout.strip() == "", out.stdout


def test_bad_config_fails_fast_naming_the_key(tmp_path):
    proc, run_dir = run_train(tmp_path, "orchestrator.max_stalenes=2", timeout=60)
    assert proc.returncode == 2
    assert "orchestrator.max_stalenes" in proc.stderr and "max_staleness" in proc.stderr
    assert not run_dir.exists()
