"""Real SGLang 0.5.23 servers on CPU, for the SGLang tier (``DORA_SGLANG=1``).

The venv comes from ``tools/setup_sglang_cpu.sh`` (``DORA_SGLANG_PYTHON`` or the default
:data:`~dora_megatron.config.sglang.CPU_SGLANG_PYTHON`). Each server is started with the argv and
environment dora's own launcher computes (:func:`dora_megatron.rollout.sglang.args.server_argv`,
``server_env``) from ``configs/cpu_sglang.yaml``'s ``rollout:``/``sglang:`` sections, so a test
runs exactly the CPU flags users get. :func:`start_real_sglang` mirrors
``tests.sglang_standin.start_standin`` (same arguments, an object with ``url``, ``log()`` and
``stop()``), so a test can run one scenario against both.

Opt-in like the vLLM tier: without ``DORA_SGLANG=1`` :func:`require_sglang` skips; with it and no
venv it skips locally and fails under ``CI=true`` (the tier was asked for and cannot run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pytest

from dora_megatron.config.sglang import CPU_SGLANG_PYTHON
from tests.helpers.tiers import require_venv

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "configs" / "cpu_sglang.yaml"
SGLANG_PYTHON = os.path.expanduser(os.environ.get("DORA_SGLANG_PYTHON") or CPU_SGLANG_PYTHON)


def require_sglang() -> str:
    """The SGLang venv's interpreter, or a skip (a failure in CI with ``DORA_SGLANG=1``)."""
    return require_venv("DORA_SGLANG", SGLANG_PYTHON, "SGLang", "tools/setup_sglang_cpu.sh", "DORA_SGLANG_PYTHON")


def cpu_config(overrides: Iterable[str] = ()):
    """``configs/cpu_sglang.yaml`` with ``sglang.python`` pointing at the tier's venv."""
    from dora_megatron.config.schema import load_config

    return load_config(CPU_CONFIG, [f"sglang.python={SGLANG_PYTHON}", *overrides])


@dataclass
class RealSGLang:
    """A real SGLang server started by a test; :meth:`stop` ends it (and its scheduler and
    detokenizer children: it leads its own process group) by pid."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    ready_s: float = 0.0  # start to /health 200, seconds

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGKILL of the whole group at once: a test's server holds nothing to save, and 0.5.23's
        SIGTERM path sleeps 5 s "before crash diagnostics" once its scheduler child is gone."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=timeout_s)


def server_command(model_dir: str, port: int, *, weight_version: str = "0", max_running: int = 8,
                   load_format: str = "auto", extra_args: Iterable[str] = (), overrides: Iterable[str] = (),
                   routed_experts: bool = False) -> tuple[tuple[str, ...], dict[str, str]]:
    """argv and environment of one CPU server, as dora's launcher builds them."""
    from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv, server_env

    cfg = cpu_config([f"rollout.max_running={max_running}", f"sglang.load_format={load_format}", *overrides])
    cfg.rollout.sglang_args = [*cfg.rollout.sglang_args, *extra_args]  # the config's (--dtype float32) first
    spec = InstanceSpec("sgl", str(model_dir), "127.0.0.1", port, None, 0, cfg.sglang.tp_size, str(weight_version))
    return server_argv(spec, cfg.sglang, cfg.rollout, routed_experts), server_env(cfg.rollout)


def start_real_sglang(model_dir: str, log_dir: Path, *, name: str = "sgl", weight_version: str = "0",
                      load_format: str = "auto", max_running: int = 8, timeout_s: float = 300.0,
                      extra_args: tuple[str, ...] = (), overrides: tuple[str, ...] = (),
                      routed_experts: bool = False) -> RealSGLang:
    """Start one real SGLang server on a free loopback port and wait (bounded) until ``/health``
    answers 200. ``extra_args``: more SGLang flags; ``overrides``: ``--set``-style keys of the
    config (``sglang.speculative_algorithm=NGRAM`` ...)."""
    from dora_megatron.ports import free_port

    require_sglang()
    port = free_port()
    argv, env = server_command(model_dir, port, weight_version=weight_version, max_running=max_running,
                               load_format=load_format, extra_args=extra_args, overrides=overrides,
                               routed_experts=routed_experts)
    log_path = Path(log_dir) / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env}, start_new_session=True)
    inst = RealSGLang(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang exited ({proc.returncode}):\n{inst.log()[-4000:]}")
            try:
                with urllib.request.urlopen(inst.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        inst.ready_s = time.monotonic() - start
                        return inst
            except OSError:
                pass
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"SGLang not healthy after {timeout_s:.0f} s:\n{inst.log()[-4000:]}")
            time.sleep(0.5)
    except BaseException:
        inst.stop()
        raise


#: the environment of the tier's jobs, which their SGLang servers inherit: no py-spy or CUDA core
#: dump "before crash" when a job stops its servers (0.5.23's ``tokenizer_manager.py`` sleeps 5 s
#: first "to let GPU activity settle", on every stop: its scheduler child exits on the SIGTERM)
QUICK_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


@pytest.fixture(scope="module")
def quick_server_stops():
    """:data:`QUICK_STOP_ENV` for a module's jobs (restored afterwards)."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in QUICK_STOP_ENV.items():
            env.setenv(key, value)
        yield


class Budget:
    """One test's time, shared by its waits: each wait gets what is left of it, so a hang fails with
    the name of what it waited for before pytest's own limit (600 s, ``pytest.ini``) kills the test.
    WHY not a bound per wait: a test waits several times, and on a loaded 2-core machine a real
    server's start alone took 137 s; bounds that each fit add up past pytest's limit."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        """Seconds left (at least 1, so a wait still looks once and then fails with its name)."""
        return max(1.0, self.end - time.monotonic())


def run_sglang_train(tmp_path: Path, *overrides: str, budget: Budget) -> tuple[subprocess.CompletedProcess, Path]:
    """``dora train`` on ``configs/cpu_sglang.yaml`` with the tier's interpreter, bounded by what is
    left of ``budget``: one that does not end in time fails with the tail of its output (SIGKILL of
    the launcher: the controller runs in it, and every child it started dies with it)."""
    from tests.helpers.train_job import run_train

    limit = budget.left()
    try:
        return run_train(tmp_path, f"sglang.python={SGLANG_PYTHON}", *overrides, config=CPU_CONFIG.name,
                         timeout=limit)
    except subprocess.TimeoutExpired as hung:
        tail = [(s.decode(errors="replace") if isinstance(s, bytes) else s or "")[-3000:]
                for s in (hung.stdout, hung.stderr)]
        pytest.fail(f"dora train on real SGLang did not end within {limit:.0f} s (of the test's "
                    f"{budget.total_s:.0f}):\n{tail[0]}\n{tail[1]}")


def engine_log(run_dir: Path, name: str) -> str:
    """An instance's log in a job's run directory (a restarted instance appends to it)."""
    return (run_dir / "logs" / f"{name}.log").read_text(errors="replace")


def check_secret_kept(run_dir: Path) -> None:
    """The job's secret (SGLang's keys, from its ``--config``) is in no file but its own two 0600
    ones: the servers logged their resolved arguments, keys redacted."""
    from dora_megatron.comm import auth

    secret = (run_dir / auth.SECRET_FILE).read_text().strip().encode()
    kept = {run_dir / auth.SECRET_FILE, run_dir / auth.SGLANG_KEYS_FILE}
    assert "<redacted>" in engine_log(run_dir, "engine0")
    assert not [p for p in run_dir.rglob("*") if p.is_file() and p not in kept and secret in p.read_bytes()]


def check_weight_group(run_dir: Path, summary: dict, instances: int) -> None:
    """Versions reached every real instance over the gloo group, each paused around its push."""
    assert summary["weight_push_bytes"] > 0 and summary["checksum_mismatches"] == 0
    for i in range(instances):
        log = engine_log(run_dir, f"engine{i}")
        for call in ("init_weights_update_group", "update_weights_from_distributed", "pause_generation",
                     "continue_generation"):
            assert f'POST /{call} HTTP/1.1" 200' in log, (f"engine{i}", call, log[-2000:])
