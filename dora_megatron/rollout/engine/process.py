"""Start and stop an embedded engine as a child process (``python -m dora_megatron.cli.serve``).

Why: tests, benchmarks and the local launcher all need "an engine on a free loopback port"; the
server prints its bound address on its first stdout line, which is parsed here, so port 0 can
be used without races.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Sequence

_LISTEN = re.compile(r"listening on (http://[0-9.]+:\d+)")


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen
    log_lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(
    model_dir: str,
    *,
    max_running: int = 32,
    num_threads: int = 1,
    weight_version: str = "0",
    device: str = "cpu",
    host: str = "127.0.0.1",
    port: int = 0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """Spawn ``dora serve`` and wait until ``/health`` answers 200."""
    cmd = [
        sys.executable, "-m", "dora_megatron.cli.serve", "--model", str(model_dir), "--port", str(port),
        "--host", host, "--device", device, "--max-running", str(max_running),
        "--weight-version", str(weight_version), "--num-threads", str(num_threads), *extra_args,
    ]
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", str(num_threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
    lines: list[str] = []
    url_box: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            del lines[:-200]
            m = _LISTEN.search(line)
            if m and not url_box:
                url_box.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    ready.wait(timeout_s)
    ep = EngineProcess(url_box[0] if url_box else "", proc, lines)
    if not url_box:
        ep.stop()
        raise RuntimeError("engine did not start:\n" + "\n".join(lines[-30:]))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("engine exited:\n" + "\n".join(lines[-30:]))
        try:
            with urllib.request.urlopen(ep.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return ep
        except OSError:
            pass
        time.sleep(0.1)
    ep.stop()
    raise RuntimeError(f"engine at {ep.url} not healthy after {timeout_s} s")
