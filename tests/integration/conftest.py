"""Shared integration fixtures: a tiny random Qwen3-MoE directory (init std 0.1 so layers matter)."""

from __future__ import annotations

import pytest

from tests.helpers.models import make_tiny_moe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tiny MoE with seed 0; a test module may override it (e.g. another seed)."""
    return make_tiny_moe(tmp_path_factory.mktemp("moe"), seed=0)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real one-host SLURM cluster (munged, slurmctld, slurmds n1-n3) for the session, stopped by pid.

    Skipped with the reason when the Debian packages (``slurm-wlm``, ``munge``) are missing, except
    under ``CI=true``, where that is a failure: CI installs them (``tools/install_slurm.sh``)."""
    import os

    from tests.helpers.slurm_cluster import SlurmCluster, ensure_hosts, missing_binaries

    def unavailable(why: str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"real-SLURM tests cannot run in CI: {why} (run tools/install_slurm.sh as root)")
        pytest.skip(f"real-SLURM tests need slurm-wlm and munge: {why} (tools/install_slurm.sh installs them)")

    missing = missing_binaries()
    if missing:
        unavailable(f"not installed: {', '.join(missing)}")
    if os.geteuid() != 0:
        unavailable("the test cluster runs its daemons as root (SlurmUser=root)")
    problem = ensure_hosts()
    if problem:
        unavailable(problem)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
