"""Every route of every server the project starts asks for the job's secret.

The routes come from the servers' own tables (the aiohttp router of the embedded engine and of the
SGLang stand-in, :data:`~dora_megatron.trainer.service.ROUTES` that the trainer's handler serves
from), so a route added without the check fails here. Each is called without a credential (401),
with a wrong one (403) and with the right one (neither); only ``/health`` answers without one, and
says nothing but health. Then the paths a request names: checkpoints and weights stay in the job.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dora_megatron.comm import auth

pytestmark = pytest.mark.integration

SECRET = auth.new_secret()
WRONG = auth.new_secret()


def aiohttp_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route in the application's router (``*`` routes as POST)."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info()
        path = info.get("path") or info.get("formatter")
        out.append(("POST" if route.method == "*" else route.method, path))
    return sorted(set(out))


async def call_all(app, routes, headers_of) -> dict[tuple[str, str, str], tuple[int, str]]:
    from aiohttp.test_utils import TestClient, TestServer

    results = {}
    async with TestClient(TestServer(app)) as client:
        for method, path in routes:
            for who, headers in headers_of.items():
                if method == "HEAD" and who == "right":
                    continue  # aiohttp's automatic HEAD of a GET: the GET itself is called with the secret
                async with client.request(method, path, headers=headers, data=b"") as resp:
                    results[(method, path, who)] = (resp.status, (await resp.read()).decode(errors="replace"))
    return results


CREDENTIALS = {"none": {}, "wrong": auth.auth_headers(WRONG), "right": auth.auth_headers(SECRET)}


def check_levels(results, open_paths) -> None:
    bad = []
    for (method, path, who), (status, body) in sorted(results.items()):
        if path in open_paths:
            if status != 200 or (method != "HEAD" and set(json.loads(body)) - {"status", "ready"}):
                bad.append(f"{method} {path} ({who}): {status} {body[:80]}")
        elif who == "none" and status != 401 or who == "wrong" and status != 403 \
                or who == "right" and status in (401, 403):
            bad.append(f"{method} {path} ({who}): {status} {body[:120]}")
        assert SECRET not in body and WRONG not in body
    assert not bad, "routes without the job's check:\n" + "\n".join(bad)


def test_every_route_of_the_embedded_engine_asks_for_the_secret(model_dir):
    from dora_megatron.rollout.engine.server import build_app

    app = build_app(model_dir, max_running=2, keys=auth.Keys(SECRET, SECRET))
    routes = aiohttp_routes(app)
    assert ("POST", "/dora/export_request") in routes and ("POST", "/update_weights_from_disk") in routes
    results = asyncio.run(call_all(app, routes, CREDENTIALS))
    check_levels(results, auth.OPEN_PATHS)
    # the right credential reached the handlers: their own answers, not the gate's
    assert results[("GET", "/get_weight_version", "right")][0] == 200
    assert results[("POST", "/generate", "right")][0] == 400  # an empty body is a bad request


def test_the_engines_admin_routes_are_sglang_0_5_23s():
    """Every engine route SGLang also serves is admin here exactly when 0.5.23 marks it so."""
    from dora_megatron.rollout.engine.server import ADMIN_PATHS
    from tests.sglang_wheel import load_auth

    wheel = load_auth()
    if wheel is None:
        pytest.skip("the SGLang 0.5.23 wheel is not unpacked (tools/setup_env.sh)")
    from dora_megatron.rollout.engine.server import EngineServer, ServerOptions

    app = EngineServer(scheduler=None, options=ServerOptions(model_path="unused")).app()  # routes only
    ours = {p for _, p in aiohttp_routes(app)}
    shared = sorted(p for p in ours if p in wheel.levels)
    assert len(shared) > 15
    differ = [p for p in shared if (p in ADMIN_PATHS) != (wheel.levels[p] != "NORMAL")]
    assert differ == []
    assert all(p.startswith("/dora/") for p in ADMIN_PATHS - set(shared))


def test_every_route_of_the_sglang_standin_asks_for_the_keys_as_0_5_23(model_dir):
    from tests.sglang_standin import StandIn
    from aiohttp import ClientSession, web

    async def main():
        async with ClientSession() as http:
            app = StandIn("http://127.0.0.1:9", "auto", http).app(SECRET, SECRET)
            assert isinstance(app, web.Application)
            return await call_all(app, aiohttp_routes(app), CREDENTIALS)

    results = asyncio.run(main())
    bad = [f"{m} {p} ({who}): {s}" for (m, p, who), (s, _) in results.items()
           if not p.startswith("/health") and (who != "right") != (s == 401)]
    assert not bad, bad  # 0.5.23 answers 401 to a missing and to a wrong key alike


class FakeWorker:
    """Records what the service asked of it: a refused request must leave no trace here."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[str, Any]] = []

    def data_rows(self, lengths):  # one data-parallel rank: it trains every row of a batch directory
        return list(range(len(lengths)))

    def train_step(self, samples):
        self.calls.append(("train", len(samples)))
        return {}

    def export_snapshot(self, out_dir):
        return None

    def save_checkpoint(self, path):
        self.calls.append(("save", path))

    def load_checkpoint(self, path):
        self.calls.append(("load", path))

    def push_weights(self, *args, **kwargs):
        self.calls.append(("push", args))
        return {}


def http(method: str, url: str, body: dict | None = None, secret: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=auth.auth_headers(secret))
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def trainer_service(tmp_path):
    from dora_megatron.trainer.service import TrainerService

    worker = FakeWorker()
    service = TrainerService(worker, tmp_path / "run", rank=0, world_size=1, secret=SECRET)
    ready = tmp_path / "ready.json"
    thread = threading.Thread(target=service.leader_loop, args=("127.0.0.1", 0, ready), daemon=True)
    thread.start()
    for _ in range(200):
        if ready.exists() and ready.read_text():
            break
        threading.Event().wait(0.05)
    url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    yield url, worker, tmp_path / "run"
    try:
        http("POST", url + "/shutdown", {}, SECRET)
    except OSError:  # a test already shut it down
        pass
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_every_route_of_the_trainer_service_asks_for_the_secret(trainer_service):
    from dora_megatron.trainer.service import ROUTES

    url, worker, _ = trainer_service
    bad = []
    # /shutdown last: with the right secret it ends the service
    for method, path in sorted(ROUTES, key=lambda r: r[1] == "/shutdown"):
        for who, secret, want in (("none", None, 401), ("wrong", WRONG, 403), ("right", SECRET, None)):
            status, body = http(method, url + path, None if method == "GET" else {}, secret)
            if path == "/health":
                expected = {"ready": True} if who != "right" else {"ready": True, "version": 0, "world_size": 1}
                if status != 200 or body != expected:
                    bad.append(f"{method} {path} ({who}): {status} {body}")
            elif (want is None and status in (401, 403)) or (want is not None and status != want):
                bad.append(f"{method} {path} ({who}): {status} {body}")
    assert not bad, bad
    assert worker.calls == []  # every right call had an empty body (400): nothing was done either


def test_the_trainer_keeps_checkpoints_in_the_run_directory(trainer_service, tmp_path):
    url, worker, run_dir = trainer_service
    outside = tmp_path / "elsewhere"
    for op in ("save_checkpoint", "load_checkpoint"):
        for path in (outside, run_dir / ".." / "elsewhere", Path("/tmp")):
            status, body = http("POST", f"{url}/{op}", {"path": str(path)}, SECRET)
            assert status == 403, body
            assert "only under the run directory" in body["error"]
    assert worker.calls == [] and not outside.exists()
    status, body = http("POST", f"{url}/save_checkpoint", {"path": str(run_dir / "checkpoints" / "c1")}, SECRET)
    assert status == 200, body
    assert worker.calls == [("save", str(run_dir / "checkpoints" / "c1"))]


def test_the_trainer_reads_batch_files_only_in_the_run_directory(trainer_service, tmp_path):
    """A ``/train`` that names a batch directory outside the run directory is refused before any
    file is opened; the same batch written inside it trains."""
    from array import array

    from dora_megatron.comm.batch_files import write_batch
    from dora_megatron.comm.train_sample import TrainSample

    url, worker, run_dir = trainer_service
    samples = [TrainSample([1, 2], array("i", [3, 4]), array("f", [-0.5, -0.5]), version=0, reward=float(i),
                           group_id="g0") for i in range(2)]
    for where in (tmp_path / "elsewhere", run_dir / ".." / "elsewhere2"):
        entry = write_batch(where, samples)
        status, body = http("POST", f"{url}/train", {"step": 0, "batch": entry}, SECRET)
        assert status == 403 and "batch files only under the run directory" in body["error"], body
    assert worker.calls == []
    # spooled routed experts are read from ``<dir>/../routed``: a batch at the run directory's top
    # would read them from outside it (403 before any file is opened; else a 400 for the missing files)
    spooled = {"prompt_tokens": 2, "response_tokens": 2, "reward": 0.0, "group_id": "g0", "routed_ids": 4,
               "routed_at": ["routed_000000.bin", 0, "int8"]}
    status, body = http("POST", f"{url}/train", {"step": 0, "batch": {"dir": str(run_dir), "samples": [spooled]}},
                        SECRET)
    assert status == 403 and "batch files only under the run directory" in body["error"], body
    status, body = http("POST", f"{url}/train", {"step": 0, "batch": write_batch(run_dir / "batches" / "step_0",
                                                                                  samples)}, SECRET)
    assert status == 200, body
    assert worker.calls == [("train", 2)]


def test_engines_load_weights_only_from_their_model_or_the_jobs_snapshots(model_dir, tmp_path):
    import shutil

    from aiohttp.test_utils import TestClient, TestServer

    from dora_megatron.rollout.engine.server import build_app

    snapshots = tmp_path / "run" / "weights"
    shutil.copytree(model_dir, snapshots / "v000001")
    shutil.copytree(model_dir, tmp_path / "foreign")
    app = build_app(model_dir, max_running=2, keys=auth.Keys(SECRET, SECRET), weights_roots=(str(snapshots),))
    headers = auth.auth_headers(SECRET)

    async def main():
        async with TestClient(TestServer(app)) as c:
            out = []
            for path, version in ((tmp_path / "foreign", "9"), (snapshots / "v000001", "1"), (model_dir, "2")):
                r = await c.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version},
                                 headers=headers)
                out.append((r.status, (await r.json())["message"]))
            r = await c.get("/get_weight_version", headers=headers)
            return out, (await r.json())["weight_version"]

    answers, version = asyncio.run(main())
    assert answers[0][0] == 403 and "weights load only from the model directory" in answers[0][1]
    assert [a[0] for a in answers[1:]] == [200, 200]
    assert version == "2"  # the refused load changed nothing; the two allowed ones did


def test_the_servers_above_are_every_server_in_the_package():
    """A new listener anywhere in dora_megatron fails here until its routes are tested above."""
    import re

    root = Path(__file__).resolve().parents[2] / "dora_megatron"
    listeners = re.compile(r"web\.Application\(|HTTPServer\(|asyncio\.start_server\(|\.TCPSite\(|web\.run_app\(|"
                           r"socketserver\.|\.listen\(")
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if listeners.search(p.read_text()))
    # the engine's app, `dora serve` running it (bound before the model loads), the trainer service
    assert found == ["cli/serve.py", "rollout/engine/server.py", "trainer/service.py"]
