"""The SLURM environment of a job: its nodes, this node, GPUs per node.

WHY a pure reader: every node of a job runs ``dora train`` and must compute the same plan, and
``dora train --dry-run --slurm-env ...`` must compute it on a laptop for any allocation. So this
module only turns a mapping of environment variables (``os.environ`` or fakes) into a
:class:`SlurmEnv`; nothing here calls ``scontrol`` or touches the machine.

Variables read: ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``; compressed forms such as
``node[001-004,007]``, ``gpu-a[1-2],gpu-b7`` and ``r[1-2]n[01-02]`` are expanded here),
``SLURM_JOB_ID``, ``SLURM_NODEID`` or ``SLURMD_NODENAME`` (this node), ``SLURM_NTASKS``, and for GPUs
``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE`` (``8`` or ``h100:8``), ``SLURM_JOB_GPUS`` /
``CUDA_VISIBLE_DEVICES`` (index lists).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

#: the job id of a plan made outside a SLURM job (no SLURM_JOB_ID: ``--dry-run --slurm-env ...``)
DRY_RUN_JOB_ID = "dry-run"


class SlurmEnvError(ValueError):
    pass


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"unbalanced ']' in nodelist {s!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmEnvError(f"unbalanced '[' in nodelist {s!r}")
    out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def _expand_range(body: str, whole: str) -> list[str]:
    items = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise SlurmEnvError(f"bad range {part!r} in nodelist {whole!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            items.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmEnvError(f"descending range {part!r} in nodelist {whole!r}")
        width = len(lo)  # zero padding comes from the lower bound, as SLURM writes it
        items.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return items


def _expand_one(token: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", token)
    if not m:
        return [token]
    head, tail = token[: m.start()], token[m.end():]
    return [head + x + rest for x in _expand_range(m.group(1), whole) for rest in _expand_one(tail, whole)]


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[001-003,007],login1"`` -> ``["node001", "node002", "node003", "node007", "login1"]``."""
    hosts: list[str] = []
    for token in _split_top(nodelist):
        hosts.extend(_expand_one(token, nodelist))
    if len(set(hosts)) != len(hosts):
        raise SlurmEnvError(f"nodelist {nodelist!r} names a node twice")
    return hosts


def _gpu_count(env: Mapping[str, str]) -> int | None:
    v = env.get("SLURM_GPUS_ON_NODE")
    if v and v.strip().isdigit():
        return int(v)
    v = env.get("SLURM_GPUS_PER_NODE")
    if v:
        m = re.search(r"(\d+)(?:\(|$)", v.split(",")[0])  # "8", "h100:8", "gpu:8(x4)"
        if m:
            return int(m.group(1))
    for key in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        v = env.get(key)
        if v and v.strip():
            return len([x for x in v.split(",") if x.strip()])
    return None


@dataclass(frozen=True)
class SlurmEnv:
    job_id: str
    nodes: tuple[str, ...]
    node_index: int | None  # this node's position in ``nodes`` (None: not inside the job, e.g. a dry run)
    gpus_per_node: int | None
    ntasks: int | None

    @property
    def this_node(self) -> str | None:
        return None if self.node_index is None else self.nodes[self.node_index]


def read_slurm_env(env: Mapping[str, str]) -> SlurmEnv:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set: run inside a SLURM job, or give a fake environment "
                            "with --slurm-env SLURM_JOB_NODELIST=node[001-004] --slurm-env SLURM_GPUS_ON_NODE=8")
    nodes = tuple(expand_nodelist(nodelist))
    index = None
    if env.get("SLURM_NODEID", "").strip().isdigit():
        index = int(env["SLURM_NODEID"])
    elif env.get("SLURMD_NODENAME") in nodes:
        index = nodes.index(env["SLURMD_NODENAME"])
    if index is not None and not 0 <= index < len(nodes):
        raise SlurmEnvError(f"SLURM_NODEID={index} outside the {len(nodes)} nodes of the job")
    nn = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nn and nn.isdigit() and int(nn) != len(nodes):
        raise SlurmEnvError(f"SLURM_JOB_NUM_NODES={nn} but the nodelist has {len(nodes)} nodes")
    ntasks = env.get("SLURM_NTASKS")
    return SlurmEnv(env.get("SLURM_JOB_ID", DRY_RUN_JOB_ID), nodes, index, _gpu_count(env),
                    int(ntasks) if ntasks and ntasks.isdigit() else None)


def slurm_run_dir(cfg, env: SlurmEnv) -> str:
    """The run directory every node agrees on: ``run.run_dir``, else ``<output_dir>/<name>-<mode>-job<JOBID>``
    (a start-time stamp would differ between nodes; ``...-dry-run`` for a plan outside a job). It must
    be on a filesystem all nodes share."""
    if cfg.run.run_dir:
        return cfg.run.run_dir
    suffix = DRY_RUN_JOB_ID if env.job_id == DRY_RUN_JOB_ID else f"job{env.job_id}"
    return f"{cfg.run.output_dir}/{cfg.run.dir_name(cfg.orchestrator.mode, suffix)}"


def parse_env_overrides(items: Iterable[str]) -> dict[str, str]:
    """``--slurm-env`` values: ``KEY=VALUE`` or ``@FILE`` (one ``KEY=VALUE`` per line, ``#`` comments,
    an optional leading ``export``)."""
    out: dict[str, str] = {}
    for item in items:
        if item.startswith("@"):
            lines = Path(item[1:]).read_text().splitlines()
        else:
            lines = [item]
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("export "):
                line = line[len("export "):].strip()
            key, sep, value = line.partition("=")
            if not sep or not key:
                raise SlurmEnvError(f"--slurm-env expects KEY=VALUE, got {line!r}")
            out[key.strip()] = value.strip().strip("'\"")
    return out
