"""The SGLang production path, run on CPU against stand-ins for SGLang 0.5.23 servers.

Each instance is ``tests/sglang_standin.py``: the embedded engine for the arithmetic behind the
HTTP surface of SGLang 0.5.23 as its source says it behaves (weight-update sessions, empty abort
replies, plain-text flush, a pause that outlives a disk update, ``/v1/loads`` semantics, no dora
extension; each behaviour cites the SGLang file it models), validating every request body with
SGLang's own request types when the wheel is installed (``tools/setup_env.sh``). So the runtime
takes exactly the SGLang paths: migrations become abort + resubmit of prompt + partial output on a
same-version instance (re-prefill, counted), C1 is checked from the echoed versions, and weights
are pushed with the SGLang distributed-update choreography (pause, begin, buckets, end, continue)
over gloo.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.models import hf_model_dir
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.ports import free_port, free_ports
from dora_megatron.comm.engine_client import VersionMismatch
from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.rollout.sglang.engine import SGLangEngine
from dora_megatron.weights.distributed import DistributedWeightPusher
from dora_megatron.weights.results import PushError
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers.push_choreography import check_push_choreography, model_dir  # noqa: F401 - a fixture
from tests.helpers.runtime import StaticWeights
from tests.helpers.resubmit_moves import MoveLog, StaticTrainer
from tests.sglang_standin import start_standin

pytestmark = pytest.mark.integration

STANDIN = Path(__file__).resolve().parents[1] / "sglang_standin.py"


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """Three SGLang 0.5.23 stand-ins, started in parallel; stopped by pid afterwards."""
    logs = tmp_path_factory.mktemp("standin-logs")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_standin, model_dir, logs, name=f"sgl{i}", weight_version="0") for i in range(3)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 3:
            raise RuntimeError(f"stand-in start failed: {[f.exception() for f in futures if f.exception()]}")
        yield started
    finally:
        for e in started:
            e.stop()


def test_runtime_on_sglang_adapter_migrates_by_resubmit_and_keeps_outputs(engines, model_dir):
    """Migrations on SGLang are abort + resubmit of prompt + partial output, and the resubmitted
    continuation is exactly the sequence one uninterrupted greedy request gives."""
    names = [f"e{i}" for i in range(len(engines))]
    # The move under test: the first 6 groups (version 0) are placed least-loaded first, so each
    # group's greedy (identical) answers decode on different instances and end together. When step
    # 0 ends, the long answers are mid-decode on every instance and version 1 has none; with room
    # for every request on one instance (the caps), an instance is freed for version 1 by moving
    # its version-0 requests, each with the tokens it has decoded so far.
    cfg = OrchestratorConfig(mode="dora", tbs=2, rbs=6, max_staleness=2, group_size=2, rebalance_interval_s=0.05,
                             cap_before_rebalance=12, cap_after_rebalance=12,
                             # any KV use counts as pressure: a hot instance levels with its peers
                             kv_high_watermark=1e-3, kv_rebalance_min_interval_s=0.05)
    max_new = 256  # long enough that a move lands while the request decodes
    sections = {"run": RunConfig(steps=5, seed=0), "paths": StaticWeights(Path("/run"), Path(model_dir)),
                "rollout": RolloutConfig(max_new_tokens=max_new, temperature=0.0),
                "observability": ObservabilityConfig(stats_interval_s=0.02)}
    events = MoveLog()
    # the steps after step 0 wait until a request moved with its partial output has finished
    trainer = StaticTrainer(until=lambda: bool(events.carried_and_ended()), first=1)

    async def go():
        adapters = {n: SGLangEngine(SGLangClient(e.url)) for n, e in zip(names, engines)}
        for a in adapters.values():  # start every instance at version 0
            await a.update_weights_from_disk(model_dir, weight_version=0)
        rt = Runtime(Orchestrator(cfg, names), adapters, trainer, RunningSumTask(1, 30, 1.2, seed=1), ThreadScorer(running_sum_reward).score_sync,
                     **sections, events=events)
        events.records = rt.store.samples
        summary = await drive(rt)
        # greedy reference: every trained sample, and each moved one that finished but was not
        # trained, generated in one piece on one instance
        compared = events.to_compare(trainer.batches)
        ref = SGLangClient(engines[0].url)
        refs = []
        for prompt_ids, response_ids in compared:
            r = await ref.generate(prompt_ids, {"temperature": 0.0, "max_new_tokens": max_new,
                                                "stop_token_ids": [tok.EOS_ID]})
            refs.append((response_ids, r.output_ids))
        await ref.close()
        mismatches = sum(a.version_mismatches for a in adapters.values())
        for a in adapters.values():
            await a.close()
        return summary, refs, mismatches, rt

    summary, refs, mismatches, rt = asyncio.run(go())
    print({k: summary[k] for k in ("migrations", "migrations_reprefill", "reprefill_tokens", "max_live_versions")},
          "moves (sample, output tokens carried):", events.moves)
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and mismatches == 0
    assert summary["migrations_kv"] == 0, "the SGLang path must never use the KV export extension"
    assert summary["migrations_reprefill"] == len(events.moves)
    # a continuation resubmitted with its partial output finished, so the comparison below covers it
    assert events.carried_and_ended(), events.moves
    assert summary["checksum_mismatches"] == 0 and len(rt.weights.instance_checksums) >= 1  # /weights_checker was compared
    assert len(trainer.batches) == 5 and all(len(b) == 2 * 2 for b in trainer.batches)
    for got, want in refs:  # resubmitting prompt + partial output continues the same greedy sequence
        assert got == want, (tok.decode(got), tok.decode(want))


def test_distributed_push_choreography_against_sglang_0_5_23(engines, model_dir):
    """pause -> begin -> buckets -> end -> continue for the abort and retract pauses, and a push that
    fails halfway (tests/helpers/push_choreography.py says what each step asserts)."""
    check_push_choreography(engines, model_dir)


SHIM = '''#!{python}
"""Stands in for an interpreter with sglang: `-m sglang.launch_server <SGLang flags>` runs the
SGLang 0.5.23 stand-in (tests/sglang_standin.py) with the same flags."""
import os, sys
assert sys.argv[1:3] == ["-m", "sglang.launch_server"], sys.argv
os.execv({python!r}, [{python!r}, {standin!r}, *sys.argv[3:]])
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
        tmp_path, SHIM.format(python=sys.executable, standin=str(STANDIN)),
        ("cluster.share_node=true", "cluster.trainer_gpus=1", "sglang.health_path=/health", *SHORT_RUN),
        ("SLURM_JOB_NODELIST=localhost", "SLURM_NODEID=0", "SLURM_GPUS_ON_NODE=3", "SLURM_JOB_ID=7"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (run_dir / "DONE").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["lost_groups"] == 0 and summary["migrations_kv"] == 0
    assert summary["checksum_mismatches"] == 0 and summary["failed_instances"] == []
    assert "tested with SGLang" not in proc.stdout + proc.stderr  # the stand-in reports 0.5.23: no warning
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
        tmp_path, SHIM.format(python=sys.executable, standin=str(STANDIN)),
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


def test_an_instance_without_weights_checker_survives_every_weight_switch(engines, model_dir, tmp_path, caplog):
    """An SGLang build without ``/weights_checker`` (404) next to one with it: after every weight
    switch the check is attempted once on it, then switched off with one warning
    (``checksum_unavailable``); neither instance is failed and the run completes."""
    caplog.set_level(logging.WARNING, logger="dora_megatron.controller.runtime")
    bare = start_standin(model_dir, tmp_path, name="sgl-nochecker", weight_version="0", without=("/weights_checker",))
    try:
        names = ["e0", "e1"]
        cfg = OrchestratorConfig(mode="dora", tbs=2, rbs=4, max_staleness=1, group_size=2, rebalance_interval_s=0.05,
                                 cap_before_rebalance=6, cap_after_rebalance=4)
        sections = {"run": RunConfig(steps=4, seed=0), "paths": StaticWeights(Path("/run"), Path(model_dir)),
                    "rollout": RolloutConfig(max_new_tokens=16, temperature=0.0),
                    "observability": ObservabilityConfig(stats_interval_s=0.05)}
        trainer = StaticTrainer()

        async def go():
            adapters = {"e0": SGLangEngine(SGLangClient(engines[0].url)), "e1": SGLangEngine(SGLangClient(bare.url))}
            # engines[0] holds what the tests before this one left on it: start it at version 0
            await adapters["e0"].update_weights_from_disk(model_dir, weight_version=0)
            rt = Runtime(Orchestrator(cfg, names), adapters, trainer, RunningSumTask(1, 30, 1.2, seed=1),
                         ThreadScorer(running_sum_reward).score_sync, **sections, events=EventQueue())
            try:
                return await drive(rt), rt
            finally:
                for a in adapters.values():
                    await a.close()

        summary, rt = asyncio.run(go())
    finally:
        bare.stop()
    assert summary["failed_instances"] == [] and summary["lost_groups"] == 0 and len(trainer.batches) == 4
    assert summary["checksum_unavailable"] == 1 and rt.weights.checksum_off == {"e1"}
    assert summary["checksum_mismatches"] == 0 and rt.weights.instance_checksums, "e0 was still checked"
    warned = [r for r in caplog.records if "checksum_unavailable" in r.getMessage()]
    assert len(warned) == 1 and "e1" in warned[0].getMessage()
