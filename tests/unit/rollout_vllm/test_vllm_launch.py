"""vLLM instances in the local plan: command line, environment, config checks, switch mode, and the
restart-based switch through the launcher's ProcessSet (with a stand-in server process)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.launch.inputs import input_problem
from dora_megatron.launch.plan import local_plan
from dora_megatron.processes import ProcessSet
from dora_megatron.ports import free_port
from dora_megatron.rollout.vllm.launch import make_vllm_engine, served_version
from dora_megatron.rollout.vllm.server import VLLMArgsError, server_argv
from dora_megatron.rollout.vllm.switch import (EMPTY_SHA256, FileRestart, ProcessRestart, RestartRequests,
                                               checksum_differences, remote_served_model, restart_dir, switch_mode)


def _model(tmp_path: Path, moe: bool) -> Path:
    d = tmp_path / ("moe" if moe else "dense")
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe" if moe else "qwen3",
                                               **({"num_experts": 8} if moe else {})}))
    return d


def test_plan_starts_vllm_servers_from_the_vllm_venv_with_the_rl_endpoints_on(tmp_path):
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.num_instances=2", "rollout.max_running=12",
                             "vllm.python=/opt/v/bin/python", "vllm.kv_cache_space_gb=2", "run.seed=5"])
    plan = [p for p in local_plan(cfg, "/m", str(tmp_path), base_port=31000) if p.role == "engine"]
    assert [p.name for p in plan] == ["engine0", "engine1"] and [p.port for p in plan] == [31000, 31001]
    argv = list(plan[1].argv)
    assert argv[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    for flag, value in (("--model", "/m"), ("--port", "31001"), ("--dtype", "float32"), ("--seed", "6"),
                        ("--max-num-seqs", "12")):
        assert argv[argv.index(flag) + 1] == value
    assert {"--enable-scale-out", "--skip-tokenizer-init", "--enforce-eager"} <= set(argv)
    env = plan[1].env
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and env["HF_HUB_OFFLINE"] == "1"


def test_extra_args_may_not_repeat_a_flag_dora_sets():
    cfg = load_config(None, ["rollout.engine=vllm", "vllm.extra_args=[--dtype, bfloat16]"])
    with pytest.raises(VLLMArgsError, match="--dtype"):
        server_argv("/m", "127.0.0.1", 1, cfg.vllm, cfg.rollout)


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="vllm.switch"):
        load_config(None, ["vllm.switch=sometimes"])
    with pytest.raises(ConfigError, match="vllm.python"):
        load_config(None, ["vllm.python="])


def test_missing_vllm_venv_is_an_input_problem_naming_the_key_and_the_setup_script(tmp_path):
    cfg = load_config(None, ["rollout.engine=vllm", f"vllm.python={tmp_path}/none/bin/python"])
    problem = input_problem(cfg)
    assert problem.startswith("vllm.python: ") and "tools/setup_vllm.sh" in problem
    assert input_problem(load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}"])) is None


def test_switch_mode_restarts_moe_on_cpu_only_unless_forced(tmp_path):
    cfg = load_config(None, []).vllm
    dense, moe = _model(tmp_path, False), _model(tmp_path, True)
    assert switch_mode(cfg, moe, "cpu") == "restart"
    assert switch_mode(cfg, moe, "cuda") == "reload" and switch_mode(cfg, dense, "cpu") == "reload"
    cfg.switch = "reload"
    assert switch_mode(cfg, moe, "cpu") == "reload"


def test_checksum_differences_skip_the_empty_digest():
    a = {"x": "1", "y": EMPTY_SHA256, "z": "3"}
    b = {"x": "2", "y": "9", "z": "3"}
    assert checksum_differences(a, b) == ["x"]


def test_served_version_reads_the_snapshot_manifest(tmp_path):
    snap = tmp_path / "v000003"
    snap.mkdir()
    (snap / "dora_version.json").write_text(json.dumps({"version": 3}))
    assert served_version(str(tmp_path), str(tmp_path)) == 0
    assert served_version(str(snap), str(tmp_path)) == 3
    assert served_version(str(tmp_path / "nope"), str(tmp_path)) is None


STAND_IN = """
import sys
from aiohttp import web
argv = sys.argv
model = argv[argv.index("--model") + 1]
async def health(request):
    return web.json_response({"model": model})
app = web.Application()
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(argv[argv.index("--port") + 1]), print=None)
"""


def test_restart_switch_replaces_the_child_in_place_on_a_pinned_copy_of_the_snapshot(tmp_path):
    """The engine supervisor must never see the old process dead: ProcessRestart swaps the child
    synchronously (same name and place), on hard links of the snapshot that outlive its pruning
    (a later crash restart reuses that argv), then waits for health."""
    import aiohttp
    import shutil

    port = free_port("127.0.0.1")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    moe = _model(tmp_path, True)
    snap = tmp_path / "weights" / "v000001"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((moe / "config.json").read_text())
    (snap / "dora_version.json").write_text(json.dumps({"version": 1}))
    cfg = load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}"])
    url = f"http://127.0.0.1:{port}"

    async def go(procs):
        from dora_megatron.rollout.vllm.server import wait_healthy as wait_ready

        engine = make_vllm_engine(cfg, url, str(moe), procs)
        assert isinstance(engine.restart, ProcessRestart)
        await wait_ready(url, path="/health", timeout_s=60, interval_s=0.1)
        before = procs.children[0]
        await engine.restart(str(snap))
        after = procs.children[0]
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                body = await r.json()
        await engine.close()
        return before, after, body

    with ProcessSet(tmp_path / "logs", grace_s=5) as procs:
        procs.start("engine0", [sys.executable, str(script), "--model", str(moe), "--host", "127.0.0.1", "--port", str(port)])
        before, after, body = asyncio.run(go(procs))
        assert len(procs.children) == 1 and after.name == "engine0" and after is not before
        assert not before.alive() and after.alive()
        pinned = tmp_path / "serving" / "engine0-v000001"
        assert body == {"model": str(pinned)}
        shutil.rmtree(snap)  # the run's retention prunes the snapshot: the served copy stays
        assert (pinned / "config.json").is_file()
        assert served_version(str(pinned), str(moe)) == 1  # a crash restart on it is labelled v1


def _snapshot(tmp_path: Path, moe: Path, version: int) -> Path:
    snap = tmp_path / "weights" / f"v{version:06d}"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((moe / "config.json").read_text())
    (snap / "dora_version.json").write_text(json.dumps({"version": version}))
    return snap


class _Child:
    def __init__(self, name: str, host: str, port: int) -> None:
        self.name, self.argv = name, ("python", "-m", "vllm", "--model", "/m", "--host", host, "--port", str(port))


class _Procs:
    def __init__(self, *children) -> None:
        self.children, self.log_dir = list(children), "/nonexistent/logs"


def test_an_instance_of_another_node_on_the_same_port_is_switched_by_its_node_not_by_restarting_ours(tmp_path):
    """SLURM: every node's first instance has the same port. The controller's launcher holds only
    its own node's (n1:30000); n2:30000 must be restarted by n2 (before: matched by port alone,
    the switch of n2's instance restarted n1's)."""
    cfg = load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}"])
    moe = _model(tmp_path, True)
    procs = _Procs(_Child("engine0", "n1", 30000))
    assert isinstance(make_vllm_engine(cfg, "http://n1:30000", str(moe), procs, tmp_path).restart, ProcessRestart)
    remote = make_vllm_engine(cfg, "http://n2:30000", str(moe), procs, tmp_path).restart
    assert isinstance(remote, FileRestart) and remote.root == restart_dir(tmp_path)


def test_a_restart_switch_nobody_can_carry_out_is_refused_not_replaced_by_a_stale_reload(tmp_path):
    cfg = load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}"])
    moe, dense = _model(tmp_path, True), _model(tmp_path, False)
    with pytest.raises(ValueError, match="vllm.switch: http://n2:30000 must switch versions by restart"):
        make_vllm_engine(cfg, "http://n2:30000", str(moe), None)
    assert make_vllm_engine(cfg, "http://n2:30000", str(dense), None).restart is None  # reloads in place


def test_a_node_carries_out_the_controllers_restart_request_once_and_the_controller_waits_for_health(tmp_path):
    """FileRestart (controller) and RestartRequests (the instance's node) through the run directory:
    the node restarts its child on a pinned copy and acknowledges; the controller returns once the
    new process answers; a later adapter for that URL starts labelled with the served version; a
    request left by a previous job is never carried out."""
    import aiohttp

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    moe = _model(tmp_path, True)
    snap = _snapshot(tmp_path, moe, 2)
    root = restart_dir(tmp_path / "run")
    root.mkdir(parents=True)
    key = f"127.0.0.1_{port}"
    (root / f"{key}.json").write_text(json.dumps({"token": "old-job", "model": str(tmp_path / "gone")}))
    cfg = load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}", "rollout.startup_timeout_s=60"])

    async def go(procs, node):
        from dora_megatron.rollout.vllm.server import wait_healthy

        await wait_healthy(url, timeout_s=60, interval_s=0.1)
        assert node.serve() == []  # the previous job's request
        stop = asyncio.Event()

        async def node_loop():
            while not stop.is_set():
                node.serve()
                await asyncio.sleep(0.05)

        loop = asyncio.get_running_loop().create_task(node_loop())
        try:
            await FileRestart(root, url, startup_timeout_s=60)(str(snap))
        finally:
            stop.set()
            await loop
        assert node.serve() == []  # acknowledged once, not again
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                return await r.json()

    with ProcessSet(tmp_path / "run" / "logs" / "n2", grace_s=5) as procs:
        procs.start("engine1", [sys.executable, str(script), "--model", str(moe), "--host", "127.0.0.1", "--port", str(port)])
        node = RestartRequests(procs, root, tmp_path / "run" / "logs" / "serving")
        body = asyncio.run(go(procs, node))
        pinned = tmp_path / "run" / "logs" / "serving" / "engine1-v000002"
        assert body == {"model": str(pinned)} and procs.children[0].alive()
    assert remote_served_model(root, url) == str(pinned)
    engine = make_vllm_engine(cfg, url, str(moe), None, tmp_path / "run")
    assert engine._label == "2" and isinstance(engine.restart, FileRestart)


def test_a_restart_request_that_fails_on_the_node_fails_the_switch_with_the_nodes_reason(tmp_path):
    root = restart_dir(tmp_path)
    procs = _Procs(_Child("engine1", "127.0.0.1", 1))
    node = RestartRequests(procs, root, tmp_path / "serving")

    async def go():
        task = asyncio.get_running_loop().create_task(FileRestart(root, "http://127.0.0.1:1", startup_timeout_s=30)(
            str(tmp_path / "no-such-snapshot")))
        while not list(root.glob("*.json")):
            await asyncio.sleep(0.01)
        assert node.serve() == []
        with pytest.raises(RuntimeError, match="failed on its node: FileNotFoundError"):
            await task

    asyncio.run(go())


def test_slurm_plan_starts_vllm_servers_on_the_rollout_nodes(tmp_path):
    from dora_megatron.launch.cluster import PlanError, check_plan, slurm_plan
    from dora_megatron.launch.slurm import read_slurm_env

    cfg = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "cpu_slurm.yaml"),
                      ["rollout.engine=vllm", "vllm.python=/opt/v/bin/python", "rollout.num_instances=2"])
    env = read_slurm_env({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"})
    # by default each server's port is picked free on its node when it starts (launch.port_range)
    picked = [p for p in slurm_plan(cfg, env, "/run/model", str(tmp_path)).processes if p.role == "engine"]
    assert [p.port for p in picked] == [None, None]
    assert [p.argv[p.argv.index("--port") + 1] for p in picked] == ["{port:engine0}", "{port:engine1}"]
    cfg.cluster.rollout_base_port = 30000  # a site's fixed ports
    plan = slurm_plan(cfg, env, "/run/model", str(tmp_path))
    engines = [p for p in plan.processes if p.role == "engine"]
    assert [(p.name, p.host, p.port) for p in engines] == [("engine0", "n2", 30000), ("engine1", "n2", 30001)]
    argv = list(engines[1].argv)
    assert argv[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[argv.index("--host") + 1] == "n2" and argv[argv.index("--model") + 1] == "/run/model"
    assert engines[1].env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm_cache" / "engine1")
    assert plan.engine_urls == {"engine0": "http://n2:30000", "engine1": "http://n2:30001"}
    assert check_plan(plan, 0) == []
    cfg.rollout.device = "cuda"
    with pytest.raises(PlanError, match="rollout.engine vllm on SLURM is the CPU route"):
        slurm_plan(cfg, env, "/run/model", str(tmp_path))


def test_bench_runs_the_same_dora_workload_on_each_engine(tmp_path):
    from dora_megatron.launch.bench import variant_config

    base = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "cpu_vllm.yaml"), [])
    cfgs = {v: variant_config(base, v, 0, tmp_path / v, tmp_path / "model", 2) for v in ("dora_embedded", "dora_vllm")}
    assert cfgs["dora_embedded"].rollout.engine == "embedded" and cfgs["dora_vllm"].rollout.engine == "vllm"
    for c in cfgs.values():
        assert c.orchestrator.mode == "dora" and c.model.path == str(tmp_path / "model")
        assert (c.data.seed, c.run.steps, c.orchestrator.tbs) == (base.data.seed, base.run.steps, base.orchestrator.tbs)


def test_a_qwen2_moe_whose_head_dim_vllm_would_ignore_is_refused_before_start(tmp_path):
    """vLLM 0.32.0's qwen2_moe model sizes heads as hidden_size / num_attention_heads: a config.json
    whose head_dim says otherwise would be served with the wrong heads, so the job refuses it."""
    from dora_megatron.rollout.vllm.launch import vllm_problem

    def problem(**config):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 64,
                                                   "num_attention_heads": 2, **config}))
        return vllm_problem(load_config(None, ["rollout.engine=vllm", f"vllm.python={sys.executable}",
                                               f"model.path={d}"]))
    refused = problem(head_dim=16)
    assert refused is not None and refused.startswith("model.path: ") and "head_dim 16" in refused
    assert "hidden_size / num_attention_heads = 32" in refused
    assert problem(head_dim=32) is None and problem() is None
    assert problem(model_type="qwen3_moe", head_dim=16) is None  # its model file reads head_dim
