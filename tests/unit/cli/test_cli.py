"""The ``dora`` command surface: subcommands, help, laziness, unavailable commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dora_megatron.cli import main as cli

HEAVY = ("megatron", "sglang", "transformer_engine", "transformers")


def test_subcommands_match_design():
    assert list(cli.SUBCOMMANDS) == ["train", "serve", "init-model", "simulate", "bench", "convert", "export"]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: dora " + name in capsys.readouterr().out


def test_import_and_help_do_not_import_heavy_frameworks():
    code = (
        "import sys, contextlib, io\n"
        "import dora_megatron\n"
        "from dora_megatron.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main.main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "print('HEAVY', bad)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out
    assert "TORCH False" in out, out


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage: dora" in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "dora_megatron", "--help"], capture_output=True, text=True, check=True)
    assert "dora_megatron" in out.stdout


def test_train_input_errors_name_what_is_wrong(tmp_path, capsys):
    assert cli.main(["train", "--resume", str(tmp_path / "gone")]) == 2
    assert f"--resume {tmp_path / 'gone'}: no such run directory" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(tmp_path)]) == 2  # a directory, but not a run
    assert f"--resume {tmp_path}: not a run directory (no config.yaml" in capsys.readouterr().err
    config = Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
    assert cli.main(["train", "--config", str(config), "--set", "orchestrator.tbs=0"]) == 2
    assert "orchestrator.tbs: must be >= 1, got 0" in capsys.readouterr().err


def test_unusable_model_path_is_refused_before_anything_starts(tmp_path, capsys):
    from dora_megatron.models.presets import create_model_dir

    config = Path(__file__).resolve().parents[3] / "configs" / "cpu_tiny.yaml"
    run_dir = tmp_path / "run"
    common = ["--set", "model.warm_start=", "--set", f"run.run_dir={run_dir}"]
    assert cli.main(["train", "--config", str(config), "--set", f"model.path={tmp_path / 'none'}", *common]) == 2
    assert f"model.path: {tmp_path / 'none'} is not a directory" in capsys.readouterr().err
    model = create_model_dir("tiny-dense", tmp_path / "m", seed=0)
    (model / "tokenizer.json").unlink()
    assert cli.main(["train", "--config", str(config), "--set", f"model.path={model}", *common]) == 2
    assert f"no tokenizer.json in {model}" in capsys.readouterr().err
    assert cli.main(["bench", "--config", str(config), "--set", f"model.path={model}", "--out", str(tmp_path / "b"),
                     *common]) == 2
    assert f"dora bench: model.path: no tokenizer.json in {model}" in capsys.readouterr().err
    assert not run_dir.exists() and not (tmp_path / "b").exists()  # nothing was started or written


def test_simulate_config_error_goes_to_stderr(tmp_path, capsys):
    assert cli.main(["simulate", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert "config error:" in captured.err and "config file not found" in captured.err and captured.out == ""


@pytest.mark.parametrize("flag,value,why", [
    ("--max-running", "0", "must be >= 1, got 0"),
    ("--block-size", "-4", "must be >= 1, got -4"),
    ("--kv-blocks", "0", "must be >= 1, got 0"),
    ("--context-length", "0", "must be >= 1, got 0"),
    ("--num-threads", "0", "must be >= 1, got 0"),
    ("--max-waiting", "-1", "must be >= 0, got -1"),
    ("--port", "70000", "must be >= 0 and <= 65535, got 70000"),
    ("--group-connect-timeout", "0", "must be > 0, got 0"),
    ("--max-running", "many", "must be an integer, got 'many'"),
])
def test_serve_refuses_a_bad_number_by_its_flag_before_loading_the_model(tmp_path, capsys, flag, value, why):
    args = ["serve", "--model", str(tmp_path), "--port", "0", flag, value]
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert f"argument {flag}: {why}" in capsys.readouterr().err


def test_bare_train_refuses_and_lists_the_job_configs(tmp_path, monkeypatch, capsys):
    """``dora train`` without --config (nor --resume / --dry-run) starts nothing: it names the
    missing flag and lists every job config, from a checkout's root and from elsewhere."""
    root = Path(__file__).resolve().parents[3]
    configs = sorted(p.name for p in (root / "configs").glob("*.yaml"))
    assert "cpu_tiny.yaml" in configs
    for cwd, shown in ((root, "configs"), (tmp_path, str(root / "configs"))):
        monkeypatch.chdir(cwd)
        assert cli.main(["train", "--set", f"run.output_dir={tmp_path / 'runs'}"]) == 2
        err = capsys.readouterr().err
        assert f"dora train: no --config given; choose a job config, e.g. dora train --config {shown}/cpu_tiny.yaml" in err
        for name in configs:
            assert f"  {shown}/{name} " in err, (name, err)
        assert "--dry-run (without --config) prints what the built-in defaults would run" in err
        assert not (tmp_path / "runs").exists()
