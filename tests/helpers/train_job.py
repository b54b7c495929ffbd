"""Runs ``dora train`` on ``configs/cpu_tiny.yaml`` (or another config of ``configs/``) as a subprocess; shared by the job tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_train(tmp_path: Path, *overrides: str, timeout: int = 600, config: str = "cpu_tiny.yaml"
              ) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dora_megatron", "train", "--config", str(ROOT / "configs" / config),
           "--set", f"run.run_dir={run_dir}", "--set", "observability.progress=false", *[x for o in overrides for x in ("--set", o)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, run_dir
