"""``tools/gpu_trainer_smoke.py`` stays runnable without a GPU: its configurations pass the same
checks ``dora train`` applies, and without CUDA it says so instead of failing later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[3] / "tools" / "gpu_trainer_smoke.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_every_smoke_configuration_passes_the_config_checks():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    listed = _run("--list").stdout.strip().splitlines()
    assert len(lines) == len(listed) >= 8 and all(line.endswith(" OK") for line in lines)
    for knob in ("cp", "vpp", "moe_grouped_gemm", "flex", "optimizer_cpu_offload", "fp16", "overlap_grad_reduce"):
        assert any(knob in line for line in lines), knob


def test_without_cuda_it_refuses_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the tool runs the smokes")
    proc = _run()
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
