"""What a new user meets in the first hour, through the real ``dora`` command (issue U1).

Each test runs the console script in a subprocess, as a user would, and checks the exit status
and the one line that tells what happened; none of them may start engines or a trainer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from dora_megatron.controller.main import drive

ROOT = Path(__file__).resolve().parents[3]
CPU_TINY = ROOT / "configs" / "cpu_tiny.yaml"


def dora(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The installed ``dora`` script next to this interpreter (``python -m dora_megatron`` without one)."""
    script = Path(sys.executable).with_name("dora")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "dora_megatron"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _finished_run(run_dir: Path, steps: int) -> None:
    """A run directory whose last checkpoint is the end of a finished run: the real controller state
    (the runtime driven by fake engines and a fake trainer) and the resolved config."""
    from dora_megatron.config.loader import dump_yaml
    from dora_megatron.config.schema import load_config
    from tests.helpers.runtime import make

    rt, _, _ = make(mode="dora", steps=steps, tmp_path=run_dir)
    asyncio.run(drive(rt))
    for v in range(1, steps + 1):  # the snapshots the checkpoint's unconsumed groups need
        (run_dir / "weights" / f"v{v:06d}").mkdir(parents=True)
    cfg = load_config(str(CPU_TINY), [f"run.run_dir={run_dir}", f"run.steps={steps}"])
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))


def test_resume_of_a_finished_run_says_it_is_complete_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    _finished_run(run_dir, steps=2)
    proc = dora("train", "--resume", str(run_dir), timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"run {run_dir} is complete: 2 of run.steps=2 steps done" in out, out
    assert "--set run.steps=N" in out
    assert not (run_dir / "logs").exists() and not (run_dir / "model").exists()  # nothing was started


def test_impossible_trainer_layout_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    layout = ["--set", "model.preset=tiny-dense", "--set", "trainer.ep=2", "--set", "launch.trainer_procs=2",
              "--set", f"run.run_dir={run_dir}"]
    for extra in (["--dry-run"], []):
        proc = dora("train", "--config", str(CPU_TINY), *layout, *extra, timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "trainer.ep=2 needs an MoE model with experts divisible by ep" in proc.stderr, proc.stderr
        assert "model.preset tiny-dense" in proc.stderr
    assert not run_dir.exists()  # no warm start, no engines


def test_routing_replay_on_a_dense_model_is_refused_before_anything_starts(tmp_path):
    """A dense engine answers 400 to every routed-experts request: refused up front, not mid-run."""
    run_dir = tmp_path / "run"
    proc = dora("train", "--config", str(CPU_TINY), "--set", "model.preset=tiny-dense", "--set",
                "algo.routing_replay=true", "--set", f"run.run_dir={run_dir}", "--dry-run", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "algo.routing_replay / algo.router_agreement need an MoE model" in proc.stderr, proc.stderr
    assert not run_dir.exists()


def test_convert_to_a_tp_that_does_not_divide_the_heads_is_refused_at_once(tmp_path):
    from dora_megatron.models.presets import create_model_dir

    model = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    out = tmp_path / "ckpt"
    proc = dora("convert", "hf-to-megatron", "--hf", str(model), "--out", str(out), "--tp", "3", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dora convert: --tp=3: the model's attention heads (4 query, 2 key/value) "
                                  "are not divisible by tp"), proc.stderr
    assert not out.exists()
    proc = dora("convert", "megatron-to-hf", "--ckpt", str(tmp_path / "any"), "--hf-config", str(model),
                "--out", str(out), "--pp", "3", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dora convert: --pp=3: the model's 4 layers are not divisible by pp"), proc.stderr


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    import socket

    from dora_megatron.models.presets import create_model_dir

    model = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = dora("serve", "--model", str(model), "--port", str(port), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"dora serve: cannot listen on 127.0.0.1:{port}: Address already in use"), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_serve_of_a_directory_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    proc = dora("serve", "--model", str(tmp_path), "--port", "0", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"dora serve: --model {tmp_path} is not a usable model directory: "
                                  f"no config.json in {tmp_path}"), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


SIM = ROOT / "configs" / "sim"


def test_simulate_step_time_covers_every_measured_step(tmp_path):
    """tiny.yaml: 10 steps, 2 warm-up: the reported step time is the mean of steps 2..9 (the first
    one after the warm-up included), i.e. the window's wall time over its 8 steps."""
    import json

    out = tmp_path / "t.json"
    proc = dora("simulate", "--config", str(SIM / "tiny.yaml"), "--mode", "dora", "--out", str(out), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    measured = data["series"]["step_time_s"][2:]
    assert len(measured) == 8
    assert abs(data["mean_step_time_s"] - sum(measured) / 8) < 1e-6 * data["mean_step_time_s"]
    assert f"step {data['mean_step_time_s']:8.1f} s" in proc.stdout


def test_simulate_paper_config_with_fewer_steps_lowers_the_warmup(tmp_path):
    import json

    out = tmp_path / "p.json"
    proc = dora("simulate", "--config", str(SIM / "paper_qwen32b_64gpu.yaml"), "--mode", "sync",
                "--set", "sim.steps=3", "--out", str(out), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert "sim.warmup_steps lowered from 4 to 2" in proc.stderr
    data = json.loads(out.read_text())
    assert data["steps"] == 3 and data["mean_step_time_s"] > 0  # one measured step, not null
    # both set, inconsistent: the error says what to set
    proc = dora("simulate", "--config", str(SIM / "paper_qwen32b_64gpu.yaml"), "--set", "sim.steps=3",
                "--set", "sim.warmup_steps=3", "--out", str(out), "--no-plots")
    assert proc.returncode == 2
    assert "sim.warmup_steps: 3 must be < sim.steps (3); set e.g. --set sim.warmup_steps=2" in proc.stderr


def test_simulate_without_timeline_writes_no_timeline_image(tmp_path):
    out = tmp_path / "r.json"
    proc = dora("simulate", "--config", str(SIM / "tiny.yaml"), "--mode", "dora", "--set", "sim.steps=3",
                "--set", "sim.timeline=false", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r_steps.png").is_file()
    assert list(tmp_path.glob("r_timeline_*.png")) == []


def test_jsonl_task_does_not_silently_warm_start_on_the_digit_task(tmp_path):
    import json

    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "Compute:\n\t1 + 1 \u2026 = ?", "reward_model": {"ground_truth": "2"}}) + "\n")
    common = ["train", "--config", str(CPU_TINY), "--set", "data.task=jsonl", "--set", f"data.path={data}", "--dry-run"]
    proc = dora(*common, timeout=60)  # cpu_tiny.yaml warm-starts on digit_cipher
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.warm_start: 'digit_cipher' is a supervised warm start on that digit task, not on data.task jsonl" \
        in proc.stderr, proc.stderr
    # without it, a prompt with newlines, a tab and an ellipsis passes the input checks
    proc = dora(*common, "--set", "model.warm_start=", timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_resume_of_a_directory_that_is_not_a_run_says_so(tmp_path):
    proc = dora("train", "--resume", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"--resume {tmp_path}: not a run directory (no config.yaml"), proc.stderr


def test_init_model_does_not_overwrite_an_existing_directory(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    proc = dora("init-model", "--preset", "tiny-dense", "--out", str(out), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"dora init-model: --out {out} is a non-empty directory; choose a new directory "
                                  "or pass --force"), proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    proc = dora("init-model", "--preset", "tiny-dense", "--out", str(out), "--force", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file() and (out / "mine.txt").read_text() == "keep me"


def test_convert_of_an_unsupported_model_type_is_one_line_before_any_rank_starts(tmp_path):
    import json

    from dora_megatron.models.presets import create_model_dir

    model = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    out = tmp_path / "ckpt"
    proc = dora("convert", "hf-to-megatron", "--hf", str(model), "--out", str(out), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("dora convert: config.json: model_type 'gpt2' is not supported (supported: "
                                  "qwen3, qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3)") and proc.stderr.count("\n") == 1, proc.stderr
    assert "torch" not in proc.stderr and not out.exists()
