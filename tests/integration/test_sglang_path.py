"""The SGLang production path, run on CPU against embedded engines speaking the same protocol.

The :class:`SGLangEngine` adapter hides every dora extension, so the runtime behaves exactly as it
would with SGLang servers: migrations become abort + resubmit of prompt + partial output on a
same-version instance (re-prefill, counted), C1 is checked from the echoed ``weight_version``,
and weights are pushed with the SGLang distributed-update choreography (pause, buckets, flush on
the last bucket, continue) over gloo.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.records import RuntimeOptions
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.models import hf_io
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.ports import free_port, free_ports
from dora_megatron.rollout.client import EngineClient, VersionMismatch
from dora_megatron.rollout.sglang.client import SGLangClient
from dora_megatron.rollout.sglang.engine import SGLangEngine
from dora_megatron.weights.checksum import weights_checksum
from dora_megatron.weights.distributed import DistributedWeightPusher
from dora_megatron.weights.results import PushError

pytestmark = pytest.mark.integration

MAX_NEW = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dora_megatron.models.presets import preset_config

    # a random model whose greedy answers end (EOS) after very different lengths: a long tail
    cfg = preset_config("tiny-moe")
    cfg["initializer_range"] = 0.3
    out = tmp_path_factory.mktemp("sgl-moe")
    hf_io.save_model_dir(out, cfg, hf_io.random_state_dict(cfg, 1))
    return str(out)


@pytest.fixture(scope="module")
def engines(model_dir):
    from dora_megatron.rollout.engine.process import start_engine

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:  # start in parallel; each waits for its own /health
        futures = [pool.submit(start_engine, model_dir, max_running=8, num_threads=1, weight_version="0") for _ in range(3)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 3:
            raise RuntimeError(f"engine start failed: {[f.exception() for f in futures if f.exception()]}")
        yield started
    finally:
        for e in started:
            e.proc.terminate()
        for e in started:
            e.stop()


class StaticTrainer:
    """Produces a new version label per step without changing the weights (snapshots = version 0).

    ``hold``: (step, condition): that step starts only once ``condition()`` holds (at most 30 s), so
    that on a loaded machine the run does not end before the event under test happened."""

    def __init__(self, hold: tuple[int, Callable[[], bool]] | None = None) -> None:
        self.batches: list[list[dict]] = []
        self.hold = hold

    async def train(self, step: int, samples: list[dict]) -> dict:
        if self.hold is not None and step == self.hold[0]:
            for _ in range(3000):
                if self.hold[1]():
                    break
                await asyncio.sleep(0.01)
        self.batches.append(samples)
        await asyncio.sleep(0.01)
        return {"version": step + 1, "metrics": {}, "checksum": None}

    async def save_checkpoint(self, path: str) -> dict:
        return {"path": path}


def test_runtime_on_sglang_adapter_migrates_by_resubmit_and_keeps_outputs(engines, model_dir):
    names = [f"e{i}" for i in range(len(engines))]
    cfg = OrchestratorConfig(mode="dora", tbs=2, rbs=6, max_staleness=2, group_size=2, rebalance_interval_s=0.05,
                             cap_before_rebalance=6, cap_after_rebalance=4,
                             # any KV use counts as pressure: a hot instance levels with its peers
                             # every stats tick, so migrations do not hinge on when versions arrive
                             kv_high_watermark=1e-3, kv_rebalance_min_interval_s=0.05)
    opts = RuntimeOptions(steps=5, seed=0, max_new_tokens=MAX_NEW, temperature=0.0, top_p=1.0, top_k=-1,
                          snapshot_dir=lambda v: model_dir, stats_interval_s=0.02)
    runtime: list[Runtime] = []
    trainer = StaticTrainer(hold=(1, lambda: bool(runtime) and runtime[0].migrations_fallback > 0))

    async def go():
        adapters = {n: SGLangEngine(SGLangClient(e.url)) for n, e in zip(names, engines)}
        for a in adapters.values():  # start every instance at version 0
            await a.update_weights_from_disk(model_dir, weight_version=0)
        rt = Runtime(Orchestrator(cfg, names), adapters, trainer, RunningSumTask(1, 30, 1.2, seed=1), running_sum_reward, opts)
        runtime.append(rt)
        summary = await rt.run()
        # greedy reference: every sample generated in one piece on one instance
        ref = EngineClient(engines[0].url)
        refs = []
        for batch in trainer.batches:
            for s in batch:
                r = await ref.generate(s["prompt_ids"], {"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                         "stop_token_ids": [tok.EOS_ID]})
                refs.append((s["response_ids"], r.output_ids))
        await ref.close()
        mismatches = sum(a.version_mismatches for a in adapters.values())
        for a in adapters.values():
            await a.close()
        return summary, refs, mismatches

    summary, refs, mismatches = asyncio.run(go())
    print({k: summary[k] for k in ("migrations", "migrations_reprefill", "reprefill_tokens", "max_live_versions")})
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and mismatches == 0
    assert summary["migrations_kv"] == 0, "the SGLang path must never use the KV export extension"
    assert summary["migrations_reprefill"] > 0 and summary["reprefill_tokens"] > 0
    assert len(trainer.batches) == 5 and all(len(b) == 2 * 2 for b in trainer.batches)
    for got, want in refs:  # resubmitting prompt + partial output continues the same greedy sequence
        assert got == want, (tok.decode(got), tok.decode(want))


def test_distributed_push_pauses_updates_in_buckets_and_resumes(engines, model_dir, tmp_path):
    from dora_megatron.models.presets import preset_config

    cfg = preset_config("tiny-moe")
    new = hf_io.random_state_dict(cfg, 11)
    prompt = tok.encode("123:", add_bos=True)
    long = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}

    async def go():
        clients = {f"e{i}": SGLangClient(e.url) for i, e in enumerate(engines[:2])}
        for c in clients.values():
            await c.update_weights_from_disk(model_dir, weight_version=0)
        before = await clients["e0"].generate(prompt, greedy)
        pusher = DistributedWeightPusher(clients, {n: 1 for n in clients}, master_address="127.0.0.1",
                                         master_port=free_port(), group_name="dora-test", backend="gloo",
                                         pause_mode="abort", bucket_mb=1, timeout_s=10)  # 1 MiB: several buckets
        await pusher.connect()
        in_flight = asyncio.create_task(clients["e1"].generate(prompt, long, rid="long-1"))
        for _ in range(500):
            if (await clients["e1"].server_info())["num_running_reqs"] == 1:
                break
            await asyncio.sleep(0.01)
        report = await pusher.push(7, sorted(new.items()))
        cut = await in_flight  # the abort pause returned it with its partial output
        after = {n: (await c.generate(prompt, greedy), await c.weights_checksum(), await c.weight_version())
                 for n, c in clients.items()}
        # a stale routing decision is caught from the echoed version (SGLang has no per-request check)
        adapter = SGLangEngine(clients["e0"])
        with pytest.raises(VersionMismatch):
            await adapter.generate(prompt, greedy, rid="stale", version=6)
        # an update naming a tensor the model lacks fails on the instance and is reported as such
        # (an instance that refuses before receiving leaves the broadcast to the group timeout)
        with pytest.raises(PushError) as bad:
            await pusher.push(8, [("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(4, 4))])
        await pusher.disconnect()
        for c in clients.values():
            await c.continue_generation()
            await c.close()
        return before, report, cut, after, bad.value

    before, report, cut, after, bad = asyncio.run(go())
    assert report.num_buckets > 1 and report.num_tensors == len(new) and set(report.paused) == {"e0", "e1"}
    assert cut.finish_type == "abort" and 0 < len(cut.output_ids) < 400 and cut.weight_version == "0"
    for out, checksum, version in after.values():
        assert version == "7" and out.weight_version == "7"
        assert checksum == weights_checksum(new)  # every instance holds exactly the pushed tensors
        assert out.output_ids != before.output_ids
    assert {"e0", "e1"} <= set(bad.errors) and "rejected before receiving" in bad.errors["e0"]


SHIM = '''#!{python}
"""Stands in for an interpreter with sglang: `-m sglang.launch_server <SGLang flags>` runs the
embedded engine, which speaks the same HTTP protocol, with the flags that matter mapped over."""
import argparse, os, sys
assert sys.argv[1:3] == ["-m", "sglang.launch_server"], sys.argv
p = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--weight-version", "--max-running-requests"):
    p.add_argument(flag)
a, _ = p.parse_known_args(sys.argv[3:])
host = os.environ.get("FAKE_NODE_ADDR", a.host)  # fake multi-node jobs: each 'node' is its own loopback address
os.execv({python!r}, [{python!r}, "-m", "dora_megatron", "serve", "--model", a.model_path, "--host", host,
          "--port", a.port, "--weight-version", a.weight_version, "--max-running", a.max_running_requests,
          "--num-threads", "1"])
'''


ROOT = Path(__file__).resolve().parents[2]
#: a short run: 3 steps of 2 groups x 2 samples, 16 new tokens, no TensorBoard or timeline
SHORT_RUN = ("run.steps=3", "orchestrator.tbs=2", "orchestrator.rbs=4", "orchestrator.group_size=2",
             "rollout.max_new_tokens=16", "observability.tensorboard=false", "observability.timeline=false")


def _needs_psutil() -> None:
    if subprocess.run([sys.executable, "-c", "import psutil"], capture_output=True).returncode != 0:
        pytest.skip("the trainer's end-of-run checkpoint (dist_checkpointing) needs psutil")


def slurm_train(tmp_path: Path, shim_text: str, sets: tuple[str, ...], slurm_env: tuple[str, ...]
                ) -> tuple[list[str], list[int], Path]:
    """``dora train`` on a fake SLURM allocation with a stand-in ``sglang`` interpreter
    (``shim_text``) and fixed free ports; returns the command, the ports (torchrun, trainer
    service, weight group store, rollout base) and the run directory."""
    shim = tmp_path / "sglang-python"
    shim.write_text(shim_text)
    shim.chmod(0o755)
    ports = sorted(free_ports(4))
    # the instances use rollout base + slot * 10 (+1, +2): none may be one of the fixed ports
    if len(ports) < 4 or any(ports[3] <= p < ports[3] + 30 for p in ports[:3]):
        pytest.skip("port collision in the test setup")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dora_megatron", "train", "--config", str(ROOT / "configs" / "cpu_tiny.yaml")]
    for o in ("launch.backend=slurm", "rollout.engine=sglang", "rollout.device=cuda", f"sglang.python={shim}",
              "model.warm_start=", f"run.run_dir={run_dir}", f"cluster.torchrun_port={ports[0]}",
              f"cluster.trainer_service_port={ports[1]}", f"cluster.weight_group_port={ports[2]}",
              f"cluster.rollout_base_port={ports[3]}", *sets):
        cmd += ["--set", o]
    for e in slurm_env:
        cmd += ["--slurm-env", e]
    return cmd, ports, run_dir


def test_slurm_node_runs_a_whole_single_node_job(tmp_path):
    """`dora train` with launch.backend slurm on one (fake) node: trainer (torchrun) and two
    'SGLang' instances share the node, the controller runs in-process and writes DONE."""
    _needs_psutil()
    cmd, _, run_dir = slurm_train(
        tmp_path, SHIM.format(python=sys.executable),
        ("cluster.share_node=true", "cluster.trainer_gpus=1", "sglang.health_path=/health", *SHORT_RUN),
        ("SLURM_JOB_NODELIST=localhost", "SLURM_NODEID=0", "SLURM_GPUS_ON_NODE=3", "SLURM_JOB_ID=7"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (run_dir / "DONE").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["lost_groups"] == 0 and summary["migrations_kv"] == 0
    logs = run_dir / "logs" / "localhost"
    assert (logs / "sgl0.log").is_file() and (logs / "sgl1.log").is_file() and (logs / "trainer.log").is_file()


def test_three_node_slurm_job_pushes_weights_across_nodes(tmp_path):
    """A 3-node SLURM job faked on loopback addresses 127.0.0.1-3: node 0 runs the trainer and the
    controller, nodes 1 and 2 one 'SGLang' instance each; every node runs the same `dora train`.
    With the distributed transport the trainer broadcasts each version to the instances on the
    other nodes (they reach its rendezvous at node 0's address); the other nodes stop on DONE."""
    from dora_megatron.models.presets import create_model_dir

    _needs_psutil()
    model_dir = create_model_dir("tiny-moe", tmp_path / "model", seed=0)  # on the 'shared filesystem'
    nodes = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    cmd, ports, run_dir = slurm_train(
        tmp_path, SHIM.format(python=sys.executable),
        (f"model.path={model_dir}", "sglang.health_path=/health", "sglang.weight_group_backend=gloo",
         "controller.weight_transport=distributed", "controller.weight_sync_timeout_s=120",
         "orchestrator.max_staleness=1", "cluster.join_poll_s=0.5", *SHORT_RUN),
        (f"SLURM_JOB_NODELIST={','.join(nodes)}", "SLURM_GPUS_ON_NODE=1", "SLURM_JOB_ID=8"))
    procs = [subprocess.Popen(cmd + ["--slurm-env", f"SLURM_NODEID={i}"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "FAKE_NODE_ADDR": node})
             for i, node in enumerate(nodes)]
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {i}:\n{out[-4000:]}"
    assert (run_dir / "DONE").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0
    assert summary["weight_push_bytes"] > 0 and summary["checksum_mismatches"] == 0, outs[0][-4000:]
    assert summary["failed_instances"] == [] and "weight broadcast" not in outs[0], outs[0][-4000:]  # no fallback
    for node, inst in (("127.0.0.2", "sgl0"), ("127.0.0.3", "sgl1")):
        log = (run_dir / "logs" / node / f"{inst}.log").read_text()
        assert f"listening on http://{node}:{ports[3]}" in log, log[-2000:]


def test_slurm_instance_that_never_gets_healthy_fails_the_job_with_a_message(tmp_path):
    """An 'SGLang' instance that never answers /health: the controller node stops after
    rollout.startup_timeout_s, writes FAILED (which stops the other nodes) and exits 1 naming the
    instance, without a traceback."""
    cmd, _, run_dir = slurm_train(
        tmp_path, f"#!{sys.executable}\nimport time\ntime.sleep(600)\n",
        ("cluster.share_node=true", "cluster.trainer_gpus=1", "rollout.startup_timeout_s=3"),
        ("SLURM_JOB_NODELIST=localhost", "SLURM_NODEID=0", "SLURM_GPUS_ON_NODE=3", "SLURM_JOB_ID=6"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "dora train failed on localhost" in out and "sgl" in out.split("dora train failed on localhost", 1)[1]
    assert "Traceback" not in out, out[-4000:]
    assert (run_dir / "FAILED").is_file() and not (run_dir / "DONE").exists()
