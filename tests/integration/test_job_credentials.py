"""A running job (``configs/cpu_tiny.yaml``) probed by an outside process: every call that read the
weights, used or stopped the rollout, or wrote a checkpoint where the caller said before the job had
credentials is refused (401 without, 403 with a wrong secret), the job finishes with nothing lost,
and its secret is found in no command line, log or output, only in its 0600 files."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dora_megatron.comm import auth
from tests.helpers.fault_jobs import start_train, steps_done, wait_for

pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys, urllib.request, urllib.error
engine, trainer, outside, secret = sys.argv[1:5]
calls = [("GET", engine + "/dora/weights_checksum", None), ("POST", engine + "/generate", {"input_ids": [1, 2, 3]}),
         ("POST", engine + "/pause_generation", {}), ("POST", engine + "/update_weights_from_disk",
          {"model_path": outside}), ("POST", trainer + "/save_checkpoint", {"path": outside}),
         ("POST", trainer + "/load_checkpoint", {"path": outside}), ("GET", engine + "/health", None),
         ("GET", trainer + "/health", None)]
out = []
for method, url, body in calls:
    headers = {"Authorization": "Bearer " + secret} if secret else {}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            out.append([url, r.status, r.read(200).decode(errors="replace")])
    except urllib.error.HTTPError as e:
        out.append([url, e.code, e.read(200).decode(errors="replace")])
print(json.dumps(out))
"""


def listening_url(log: Path, pattern: str) -> str | None:
    m = re.search(pattern, log.read_text(errors="replace")) if log.is_file() else None
    return m.group(1) if m else None


def probe(engine: str, trainer: str, outside: Path, secret: str) -> list:
    """The calls of an outside process (its environment holds no job secret)."""
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, engine, trainer, str(outside), secret],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_outsider_gets_nothing_from_a_running_job_and_the_secret_leaks_nowhere(tmp_path):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    job = start_train(run_dir, "run.steps=6")
    cmdlines: list[str] = []
    try:
        logs = run_dir / "logs"
        wait_for(lambda: steps_done(run_dir) >= 1, 600, "the first step", job)
        engine = listening_url(logs / "engine0.log", r"listening on (http://[\d.]+:\d+)")
        trainer = listening_url(logs / "trainer.log", r"trainer service on (http://[\d.]+:\d+)")
        assert engine and trainer
        secret = (run_dir / auth.SECRET_FILE).read_text().strip()
        pids = json.loads((run_dir / "processes.json").read_text()).values()
        for pid in pids:  # every process of the job, as `ps` shows it to every user of the node
            try:
                cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
        none, wrong = probe(engine, trainer, outside, ""), probe(engine, trainer, outside, auth.new_secret())
    finally:
        try:
            output, _ = job.communicate(timeout=900)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    assert job.returncode == 0, output[-4000:]
    assert [c[1] for c in none] == [401] * 6 + [200, 200], none
    assert [c[1] for c in wrong] == [403] * 6 + [200, 200], wrong
    assert json.loads(none[-1][2]) == {"ready": True}  # /health says nothing but health
    assert not outside.exists()  # no checkpoint written where the caller said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0

    assert len(cmdlines) >= 3 and not [c for c in cmdlines if secret in c]
    assert secret not in output
    kept = {run_dir / auth.SECRET_FILE, run_dir / auth.SGLANG_KEYS_FILE}
    for path in kept:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    leaks = [p for p in run_dir.rglob("*") if p.is_file() and p not in kept and secret.encode() in p.read_bytes()]
    assert leaks == []
    assert len(list(logs.glob("*.log"))) >= 3  # the search above did read the job's logs
