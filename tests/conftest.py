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


def pytest_collection_modifyitems(config, items):
    """Run the real-server tiers first, then the other integration tests, then the unit tests.

    Why: CI spreads modules over two workers (``--dist loadfile --no-loadscope-reorder``, in this
    order). The tier modules hold few tests but take minutes each; handed out last, one worker
    would still be starting SGLang servers long after the other ran out of work. Longest first
    lets the many short unit modules fill the gaps at the end. The sort is stable, so tests keep
    their order within a module."""

    def rank(item) -> int:
        if item.get_closest_marker("sglang") or item.get_closest_marker("vllm"):
            return 0
        return 1 if item.get_closest_marker("integration") else 2

    items.sort(key=rank)
