"""Shared pytest setup: keep torch to few threads so parallel processes do not fight over 2 cores;
session fixtures every tier may use."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach a network service


@pytest.fixture(scope="session")
def own_model(tmp_path_factory):
    """A user's model directory and dataset at toy size (:mod:`tests.helpers.own_model`), built once
    per session; read-only for tests (copy before changing anything)."""
    from tests.helpers.own_model import build_own_model

    return build_own_model(tmp_path_factory.mktemp("own_model"))
