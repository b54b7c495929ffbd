"""The controller's connection budget (controller.clients.connection_plan, which the local launcher
also checks): the open-files limit raised to the hard one and logged, the pools sized for the job's
instances, and a job that cannot run refused with the numbers and the key that fixes it, before any
process starts."""

from __future__ import annotations

import resource

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.controller.clients import connection_plan
from dora_megatron.launch.local import run_local_job


@pytest.fixture
def low_soft_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    yield min(soft, 256), hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_and_said(low_soft_limit):
    old, hard = low_soft_limit
    said: list[str] = []
    plan = connection_plan(load_config(None, ["orchestrator.cap_before_rebalance=8"]), 4, said.append)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    if hard != old:
        assert said[0] == f"open-files limit raised from {old} to {hard} (the hard limit)"
    assert plan.instances == 4 and plan.slots == 8 and plan.descriptors == hard


def test_a_job_that_cannot_fit_is_refused_naming_the_key_and_numbers():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    instances = hard  # not 3 descriptors per instance left
    with pytest.raises(ConfigError) as info:
        connection_plan(load_config(None, []), instances)
    assert info.value.path == "rollout.client_workers"
    assert f"{instances} instance(s)" in str(info.value) and str(hard) in str(info.value)


def test_dora_train_refuses_before_starting_anything(tmp_path, capsys):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cfg = load_config(None, [f"rollout.num_instances={hard}", f"run.run_dir={tmp_path / 'run'}"])
    assert run_local_job(cfg) == 2
    out = capsys.readouterr()
    assert "rollout.client_workers" in out.out + out.err
    assert not (tmp_path / "run").exists()  # no run directory, no process
