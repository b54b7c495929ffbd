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


def test_many_requests_in_flight_in_the_controller_suggest_client_workers():
    """96 instances x 64 slots: 6,144 requests on the wire in the controller's own process, above
    MANY_IN_FLIGHT; the warning names the count and the client_workers that spreads them. The same
    job with client workers, or a small one, is not warned about."""
    from dora_megatron.comm.limits import MANY_IN_FLIGHT

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 96 * 66 + 128:
        pytest.skip(f"the hard open-files limit {hard} cannot hold 96 x 64 connections")
    said: list[str] = []
    plan = connection_plan(load_config(None, ["orchestrator.cap_before_rebalance=64"]), 96, said.append)
    assert plan.in_flight == 96 * 64 > MANY_IN_FLIGHT
    warned = [s for s in said if "requests in flight" in s]
    assert len(warned) == 1
    assert "up to 6144 requests in flight" in warned[0] and "rollout.client_workers=2 or more" in warned[0]

    said.clear()
    workers = connection_plan(load_config(None, ["orchestrator.cap_before_rebalance=64", "rollout.client_workers=2"]),
                              96, said.append)
    assert workers.client_workers == 2 and not [s for s in said if "requests in flight" in s]
    connection_plan(load_config(None, ["orchestrator.cap_before_rebalance=64"]), 32, said.append)  # 2,048
    assert not [s for s in said if "requests in flight" in s]
