"""SLURM plans: roles, ranks, GPUs, ports and groups are consistent for many allocations.

The consistency rules are re-derived here from the processes' command lines (not only through
``check_plan``), so a planner bug and a checker bug cannot hide each other."""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import subprocess
from collections import Counter, defaultdict
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from dora_megatron.config.schema import load_config
from dora_megatron.launch.cluster import PlanError, check_plan, slurm_plan
from dora_megatron.launch.slurm import read_slurm_env

ROOT = Path(__file__).resolve().parents[3]
MULTI = ROOT / "configs" / "qwen3_30b_a3b_multinode.yaml"


def _flag(argv, name):
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _independent_checks(plan, gpn, tp):
    ports, gpus = defaultdict(list), defaultdict(list)
    for p in plan.processes:
        if p.port is not None:
            ports[p.host].append(p.port)
        ports[p.host].extend(p.extra_ports.values())
        gpus[p.host].extend(p.gpus)
        if p.role == "engine":  # the argv says the same as the spec
            assert int(_flag(p.argv, "--base-gpu-id")) == p.gpus[0]
            assert int(_flag(p.argv, "--tp-size")) == tp
            if p.port is not None:
                assert int(_flag(p.argv, "--port")) == p.port
    for host, ps in ports.items():
        assert len(ps) == len(set(ps)), f"{host}: duplicate port in {sorted(ps)}"
    for host, gs in gpus.items():
        assert len(gs) == len(set(gs)), f"{host}: GPU used twice: {sorted(gs)}"
        assert all(0 <= g < gpn for g in gs)
    trainers = [p for p in plan.processes if p.role == "trainer"]
    ranks = [r for p in trainers for r in p.ranks]
    assert ranks == list(range(len(ranks)))
    for k, p in enumerate(trainers):
        assert _flag(p.argv, "--node-rank") == str(k) and _flag(p.argv, "--nnodes") == str(len(trainers))
        assert int(_flag(p.argv, "--nproc-per-node")) == len(p.ranks) == len(p.gpus)
        assert _flag(p.argv, "--master-addr") == trainers[0].host
    groups = {g.name: g for g in plan.groups}
    assert groups["trainer"].world_size == len(ranks)
    engine_gpus = sum(len(p.gpus) for p in plan.processes if p.role == "engine")
    assert groups["weight_update"].world_size == 1 + engine_gpus
    assert [p.host for p in plan.processes if p.role == "controller"] == [plan.nodes[0]]
    assert check_plan(plan, gpn) == []


@pytest.mark.parametrize("nodes,gpn,trainer_nodes,tp,ep,want_instances", [
    ("gpu[0001-0008]", 8, 4, 4, 4, 8),       # 2 instances per rollout node
    ("gpu[01-16]", 8, 4, 8, 8, 12),          # 1 per node
    ("gpu[001-012]", 8, 4, 16, 8, 4),        # each instance spans 2 nodes
    ("a[1-3],b[7-9]", 4, 2, 1, 1, 16),       # 4 per node, mixed names
    ("gpu[0001-1100]", 8, 100, 4, 4, 2000),  # 1,000+ nodes
])
@pytest.mark.parametrize("fixed", [(), ("cluster.torchrun_port=29500", "cluster.trainer_service_port=29600",
                                         "cluster.weight_group_port=29700", "cluster.rollout_base_port=30000")],
                         ids=["picked-ports", "fixed-ports"])
def test_plans_are_consistent(nodes, gpn, trainer_nodes, tp, ep, want_instances, fixed):
    cfg = load_config(MULTI, [f"cluster.trainer_nodes={trainer_nodes}", f"sglang.tp_size={tp}", f"sglang.ep_size={ep}",
                              f"launch.trainer_procs={trainer_nodes * gpn}", f"sglang.enable_eplb={ep > 1}",
                              "trainer.ep=2", *fixed])
    env = read_slurm_env({"SLURM_JOB_NODELIST": nodes, "SLURM_GPUS_ON_NODE": str(gpn), "SLURM_JOB_ID": "42"})
    plan = slurm_plan(cfg, env, "/m", "/r")
    assert len(plan.engine_urls) == want_instances
    roles = Counter(plan.roles.values())
    assert roles["trainer"] == trainer_nodes and roles["rollout"] == len(env.nodes) - trainer_nodes
    _independent_checks(plan, gpn, tp)
    if tp > gpn:  # a multi-node instance: every part points at the head's dist-init address
        parts = [p for p in plan.processes if p.role == "engine" and p.name.startswith("sgl0.")]
        assert [int(_flag(p.argv, "--node-rank")) for p in parts] == list(range(tp // gpn))
        head = parts[0]
        dist, http = (head.extra_ports["dist_init"], head.port) if fixed else ("{port:sgl0.dist_init}", "{port:sgl0}")
        assert {_flag(p.argv, "--dist-init-addr") for p in parts} == {f"{head.host}:{dist}"}
        assert plan.engine_urls["sgl0"] == f"http://{head.host}:{http}"
        # the head picks its ports; the other parts wait for what it published
        assert head.auto_ports == (() if fixed else ("sgl0", "sgl0.nccl", "sgl0.dist_init"))
        assert all(not p.auto_ports for p in parts[1:])


def test_single_node_shared_gpus():
    cfg = load_config(ROOT / "configs" / "gpu_ci_small.yaml",
                      ["launch.backend=slurm", "cluster.share_node=true", "cluster.trainer_gpus=2"])
    env = read_slurm_env({"SLURM_JOB_NODELIST": "box1", "SLURM_GPUS_ON_NODE": "5"})
    plan = slurm_plan(cfg, env, "/m", "/r")
    assert plan.roles == {"box1": "trainer+rollout"}
    assert len(plan.engine_urls) == 3  # GPUs 2, 3, 4 (the trainer's tp=2 takes 0 and 1)
    _independent_checks(plan, 5, 1)


@pytest.mark.parametrize("overrides,env,match", [
    (["sglang.tp_size=12", "sglang.ep_size=4"], {"SLURM_JOB_NODELIST": "n[1-8]", "SLURM_GPUS_ON_NODE": "8"}, "multiple"),
    ([], {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_GPUS_ON_NODE": "8"}, "no rollout node"),
    ([], {"SLURM_JOB_NODELIST": "n[1-8]", "SLURM_GPUS_ON_NODE": "6"}, "trainer world size 24"),
    ([], {"SLURM_JOB_NODELIST": "n[1-8]"}, "GPUs per node unknown"),
    (["cluster.rollout_nodes=9"], {"SLURM_JOB_NODELIST": "n[1-8]", "SLURM_GPUS_ON_NODE": "8"}, "rollout_nodes"),
])
def test_impossible_allocations_are_refused(overrides, env, match):
    cfg = load_config(MULTI, overrides)
    with pytest.raises(PlanError, match=match):
        slurm_plan(cfg, read_slurm_env(env), "/m", "/r")


def test_check_plan_catches_port_and_gpu_clashes():
    cfg = load_config(MULTI, ["cluster.rollout_base_port=30000"])  # fixed ports: the plan can check them
    plan = slurm_plan(cfg, read_slurm_env({"SLURM_JOB_NODELIST": "n[1-6]", "SLURM_GPUS_ON_NODE": "8"}), "/m", "/r")
    engines = [i for i, p in enumerate(plan.processes) if p.role == "engine"]
    a, b = plan.processes[engines[0]], plan.processes[engines[1]]
    assert a.host == b.host
    plan.processes[engines[1]] = dataclasses.replace(b, port=a.port, gpus=a.gpus)
    problems = check_plan(plan, 8)
    assert any("port" in p for p in problems) and any("GPU" in p for p in problems)


def _dry_run(argv: list[str]) -> tuple[int, str]:
    from dora_megatron.cli import train

    parser = argparse.ArgumentParser()
    train.configure(parser)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = train.run(parser.parse_args(argv))
    return rc, out.getvalue()


def test_dry_run_prints_a_1000_node_plan():
    rc, out = _dry_run(["--config", str(MULTI), "--dry-run", "--slurm-env", "SLURM_JOB_NODELIST=gpu[0001-1024]",
                        "--slurm-env", "SLURM_GPUS_ON_NODE=8", "--slurm-env", "SLURM_JOB_ID=9"])
    assert rc == 0 and "plan check: OK" in out
    assert "cluster plan: 1024 node(s)" in out and "node gpu1024 [rollout]" in out
    assert out.count("sglang.launch_server") == (1024 - 4) * 2
    assert "job9" in out  # the shared run directory derives from the job id, identical on every node


def test_dry_run_reports_plan_errors(capsys):
    rc, _ = _dry_run(["--config", str(MULTI), "--dry-run", "--set", "sglang.tp_size=16", "--set", "sglang.ep_size=16",
                      "--slurm-env", "SLURM_JOB_NODELIST=n[1-5]", "--slurm-env", "SLURM_GPUS_ON_NODE=8"])
    assert rc == 2 and "needs 2 nodes" in capsys.readouterr().err


def test_local_plan_places_sglang_after_trainer_gpus():
    from dora_megatron.launch.plan import local_plan

    cfg = load_config(ROOT / "configs" / "gpu_ci_small.yaml", ["rollout.base_port=31000"])
    plan = local_plan(cfg, "/m", "/r")
    engines = [p for p in plan if p.role == "engine"]
    assert len(engines) == 2 and all("sglang.launch_server" in p.argv for p in engines)
    assert [p.gpus for p in engines] == [(2,), (3,)]  # GPUs 0 and 1 are the trainer's (tp=2)
    assert len({p.port for p in engines} | {v for p in engines for v in p.extra_ports.values()}) == 4


def test_local_plan_passes_engine_kv_budget_and_context_length():
    from dora_megatron.launch.plan import local_plan

    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", [])
    argv = next(p.argv for p in local_plan(cfg, "/m", "/r") if p.role == "engine")
    assert "--kv-blocks" not in argv and "--context-length" not in argv  # null: the engine's defaults
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", ["rollout.kv_blocks=96", "rollout.context_length=512"])
    for p in (p for p in local_plan(cfg, "/m", "/r") if p.role == "engine"):
        assert p.argv[p.argv.index("--kv-blocks") + 1] == "96"
        assert p.argv[p.argv.index("--context-length") + 1] == "512"


def test_sbatch_templates_parse_and_only_call_dora():
    scripts = sorted((ROOT / "slurm").glob("*.sbatch"))
    assert len(scripts) >= 2
    for s in scripts:
        subprocess.run(["bash", "-n", str(s)], check=True)
        body = [ln for ln in s.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        runs = [ln for ln in body if re.match(r"\s*srun\b", ln)]
        assert runs, f"{s.name}: no srun line"
        assert all('"$DORA" train' in ln or "dora train" in ln for ln in " ".join(body).split("srun")[1:])


CPU_SLURM = ROOT / "configs" / "cpu_slurm.yaml"


def test_cpu_route_plans_embedded_engines_from_the_config_without_gpus():
    """rollout.engine embedded on SLURM (no GPU in the environment): the trainer node runs
    launch.trainer_procs ranks, each rollout node rollout.num_instances engines bound to its own
    name (emulated nodes on one host must not collide on 0.0.0.0)."""
    cfg = load_config(CPU_SLURM, ["rollout.num_instances=2"])
    plan = slurm_plan(cfg, read_slurm_env({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "5"}), "/m", "/r")
    assert plan.roles == {"n1": "trainer", "n2": "rollout", "n3": "rollout"}
    engines = [p for p in plan.processes if p.role == "engine"]
    # no fixed number: each engine's node picks its port when it starts and publishes it
    assert [(p.host, p.port, p.auto_ports) for p in engines] == [
        ("n2", None, ("engine0",)), ("n2", None, ("engine1",)), ("n3", None, ("engine2",)), ("n3", None, ("engine3",))]
    for p in engines:
        assert "serve" in p.argv and _flag(p.argv, "--host") == p.host and _flag(p.argv, "--device") == "cpu"
        assert _flag(p.argv, "--port") == "{port:%s}" % p.name
        assert plan.engine_urls[p.name] == "http://%s:{port:%s}" % (p.host, p.name)
    trainer = next(p for p in plan.processes if p.role == "trainer")
    assert _flag(trainer.argv, "--host") == "n1" and "--nproc-per-node=1" in trainer.argv
    assert _flag(trainer.argv, "--master-port") == "{port:torchrun}" and _flag(trainer.argv, "--port") == "{port:trainer_service}"
    assert trainer.auto_ports == ("torchrun", "trainer_service") and plan.trainer_url == "http://n1:{port:trainer_service}"
    assert check_plan(plan, 0) == []
    fixed = slurm_plan(load_config(CPU_SLURM, ["rollout.num_instances=2", "cluster.rollout_base_port=30000",
                                               "cluster.torchrun_port=29500", "cluster.trainer_service_port=29600"]),
                       read_slurm_env({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "5"}), "/m", "/r")
    engines = [p for p in fixed.processes if p.role == "engine"]
    assert [(p.host, p.port) for p in engines] == [("n2", 30000), ("n2", 30001), ("n3", 30000), ("n3", 30001)]
    assert all(fixed.engine_urls[p.name] == f"http://{p.host}:{p.port}" and not p.auto_ports for p in engines)
    trainer = next(p for p in fixed.processes if p.role == "trainer")
    assert "--master-port=29500" in trainer.argv and _flag(trainer.argv, "--port") == "29600" and not trainer.auto_ports
    assert check_plan(fixed, 0) == []
    single = slurm_plan(load_config(CPU_SLURM, ["cluster.share_node=true"]),
                        read_slurm_env({"SLURM_JOB_NODELIST": "n1"}), "/m", "/r")
    assert single.roles == {"n1": "trainer+rollout"} and list(single.engine_urls) == ["engine0"]
    join = slurm_plan(cfg, read_slurm_env({"SLURM_JOB_NODELIST": "n4", "SLURM_JOB_ID": "9"}), "/m", "/r", join=True)
    assert list(join.engine_urls) == ["j9-engine0", "j9-engine1"] and join.controller_node == ""


@pytest.mark.parametrize("overrides,match", [
    (["rollout.engine=sglang", "rollout.device=cuda"], "GPUs per node unknown"),
    (["trainer.device=cuda"], "CPU route"),
    (["cluster.trainer_nodes=3"], "no rollout node"),
])
def test_cpu_route_refuses_what_it_cannot_run(overrides, match):
    cfg = load_config(CPU_SLURM, overrides)
    with pytest.raises(PlanError, match=match):
        slurm_plan(cfg, read_slurm_env({"SLURM_JOB_NODELIST": "n[1-3]"}), "/m", "/r")


def test_sbatch_templates_fix_no_gpu_or_cpu_count():
    """Counts a user must edit (or that a CPU cluster refuses: no GPU GRES) come from the sbatch line."""
    for s in sorted((ROOT / "slurm").glob("*.sbatch")):
        directives = [ln for ln in s.read_text().splitlines() if ln.startswith("#SBATCH")]
        assert directives, s.name
        assert not [d for d in directives if re.search(r"gpus|gres|cpus-per-task|exclusive", d)], (s.name, directives)


def test_sbatch_templates_request_the_early_warning_and_pass_it_to_dora():
    """Every template asks SLURM for ``USR1`` to its batch shell before the time limit
    (``--signal=B:USR1@N``) and forwards it to the ``srun`` step running ``dora train`` (which
    checkpoints at its next step boundary): without the directive a time-limited job gets only
    SIGTERM and ``KillWait`` seconds, too few for a checkpoint; without the trap the batch shell
    dies of the signal and the step is killed."""
    for s in sorted((ROOT / "slurm").glob("*.sbatch")):
        text = s.read_text()
        warn = [ln for ln in text.splitlines() if re.fullmatch(r"#SBATCH --signal=B:USR1@\d+", ln.strip())]
        assert len(warn) == 1 and int(warn[0].rsplit("@", 1)[1]) >= 60, (s.name, warn)
        assert re.search(r"""^trap 'kill -USR1 "\$SRUN"[^']*' USR1$""", text, re.M), s.name
        commands = text.replace("\\\n", " ").splitlines()  # continuation lines joined
        (run,) = [ln for ln in commands if ln.startswith("srun ")]
        assert run.rstrip().endswith("&") and "SRUN=$!" in commands, s.name  # in the background: the trap can run


def test_a_run_directory_name_says_its_mode_once():
    """``<name>-<mode>-<suffix>``, the mode left out when the name ends with it; a plan made outside
    a job (no SLURM_JOB_ID) names its directory ``...-dry-run``, not ``...-jobdry-run``."""
    from dora_megatron.launch.slurm import slurm_run_dir

    rc, out = _dry_run(["--config", str(MULTI), "--dry-run", "--slurm-env", "SLURM_JOB_NODELIST=gpu[0001-0008]",
                        "--slurm-env", "SLURM_GPUS_ON_NODE=8"])
    assert rc == 0 and "/runs/qwen3-30b-a3b-dora-dry-run " in out, out[-2000:]
    assert "dora-dora" not in out and "jobdry-run" not in out
    env = read_slurm_env({"SLURM_JOB_NODELIST": "n[1-5]", "SLURM_JOB_ID": "77"})
    assert slurm_run_dir(load_config(MULTI), env).endswith("/runs/qwen3-30b-a3b-dora-job77")
    assert slurm_run_dir(load_config(MULTI, ["orchestrator.mode=sync"]), env).endswith("/runs/qwen3-30b-a3b-dora-sync-job77")
    assert slurm_run_dir(load_config(ROOT / "configs" / "cpu_slurm.yaml"), env) == "runs/cpu_slurm-dora-job77"
    run = load_config(None).run  # the default name is "dora"
    assert run.dir_name("dora", "t") == "dora-t" and run.dir_name("partial", "t") == "dora-partial-t"
    run.name = "exp_dora"
    assert run.dir_name("dora", "t") == "exp_dora-t"


def test_a_local_run_directory_says_its_mode_once(tmp_path):
    from dora_megatron.launch.local import make_run_dir

    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    made = make_run_dir(cfg)
    assert made.parent == tmp_path and re.fullmatch(r"dora-\d{8}-\d{6}", made.name), made.name
