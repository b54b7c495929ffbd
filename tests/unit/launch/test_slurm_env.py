"""Reading the SLURM environment: compressed nodelists, this node, GPUs per node, --slurm-env."""

from __future__ import annotations

import pytest

from dora_megatron.launch.slurm import SlurmEnvError, expand_nodelist, parse_env_overrides, read_slurm_env


@pytest.mark.parametrize("text,want", [
    ("node001", ["node001"]),
    ("node[001-003,007]", ["node001", "node002", "node003", "node007"]),
    ("gpu-a[1-2],gpu-b7", ["gpu-a1", "gpu-a2", "gpu-b7"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("x[098-101],y", ["x098", "x099", "x100", "x101", "y"]),
])
def test_expand_nodelist(text, want):
    assert expand_nodelist(text) == want


def test_expand_large_nodelist_keeps_order_and_padding():
    nodes = expand_nodelist("gpu[0001-1024],cpu[1-3]")
    assert len(nodes) == 1027 and nodes[0] == "gpu0001" and nodes[1023] == "gpu1024" and nodes[-1] == "cpu3"
    assert len(set(nodes)) == len(nodes)


@pytest.mark.parametrize("bad", ["node[1-", "node]1", "node[3-1]", "node[a-b]", "n[1-2],n1"])
def test_bad_nodelists_are_rejected(bad):
    with pytest.raises(SlurmEnvError):
        expand_nodelist(bad)


@pytest.mark.parametrize("env,gpus", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "gpu:2(x3)"}, 2),
    ({"SLURM_JOB_GPUS": "0,1,2"}, 3),
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, 2),
    ({}, None),
])
def test_gpus_per_node_sources(env, gpus):
    e = read_slurm_env({"SLURM_JOB_NODELIST": "n[1-2]", **env})
    assert e.gpus_per_node == gpus


def test_this_node_from_nodeid_or_hostname():
    base = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "77"}
    assert read_slurm_env({**base, "SLURM_NODEID": "2"}).this_node == "n3"
    assert read_slurm_env({**base, "SLURMD_NODENAME": "n4"}).node_index == 3
    assert read_slurm_env(base).node_index is None
    with pytest.raises(SlurmEnvError):
        read_slurm_env({**base, "SLURM_NODEID": "9"})
    with pytest.raises(SlurmEnvError):
        read_slurm_env({**base, "SLURM_JOB_NUM_NODES": "3"})
    with pytest.raises(SlurmEnvError, match="--slurm-env"):
        read_slurm_env({})


def test_env_overrides_from_args_and_file(tmp_path):
    f = tmp_path / "env"
    f.write_text("# fake job\nexport SLURM_JOB_NODELIST='n[1-2]'\nSLURM_GPUS_ON_NODE=4\n")
    got = parse_env_overrides([f"@{f}", "SLURM_JOB_ID=5"])
    assert got == {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "5"}
    with pytest.raises(SlurmEnvError):
        parse_env_overrides(["NOEQUALS"])
