"""The tools a new user runs next to ``dora`` (eval, weight-sync and orchestrator benches), first contact:
results where a pipe finds them, a missing folder made rather than a traceback, and a bare run that
measures what the docs report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_digits_prints_results_on_stdout_and_progress_on_stderr(tmp_path):
    from dora_megatron.models.presets import create_model_dir

    model = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "eval_digits.py"), str(model), "--prompts", "2",
                          "--max-len", "3", "--max-new-tokens", "4", "--decode", "greedy", "--threads", "1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("greedy") and " exact " in lines[0]
    assert lines[0].endswith(str(model))
    assert " exact " not in out.stderr  # the result is not repeated among the log lines
    assert f"evaluating {model}" in out.stderr


def test_bench_weights_creates_a_missing_workdir(tmp_path, monkeypatch):
    mod = _tool("bench_weights")
    roots: list[Path] = []
    monkeypatch.setattr(mod, "bench_model", lambda kind, buckets, repeats, root: roots.append(root) or [])
    workdir = tmp_path / "not" / "yet"
    assert mod.main(["--models", "tiny", "--workdir", str(workdir)]) == 0
    assert workdir.is_dir() and len(roots) == 1 and roots[0].parent == workdir


def test_bench_weights_refuses_a_workdir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(SystemExit) as err:
        _tool("bench_weights").main(["--models", "tiny", "--workdir", str(path)])
    assert err.value.code == 2
    assert f"--workdir {path}: exists and is not a folder" in capsys.readouterr().err


def test_bench_orchestrator_default_budget_is_the_config_default(monkeypatch, capsys):
    """A bare run times the rebalance a job runs (the documented figure); ``--budget 0`` unbounded."""
    from dora_megatron.config.orchestrator import OrchestratorConfig

    mod = _tool("bench_orchestrator")
    budgets: list[int] = []
    real_build = mod.build

    def build(*args):
        budgets.append(args[-1])
        return real_build(*args)

    monkeypatch.setattr(mod, "build", build)
    small = ["--instances", "8", "--inflight", "200", "--steps", "1", "--forced", "1"]
    assert mod.main(small) == 0
    res = json.loads(capsys.readouterr().out)
    default = OrchestratorConfig().max_migrations_per_rebalance
    assert default > 0 and budgets == [default] and res["migration_budget"] == default
    assert mod.main([*small, "--budget", "0"]) == 0
    assert budgets[-1] == 0 and json.loads(capsys.readouterr().out)["migration_budget"] == 0
