"""The back-pressure count the launcher's clients keep (``connection_waits``) reaches summary.json:
the runtime is handed a function and reads it when the run ends, so calls that wait after the
hand-off are counted too."""

from __future__ import annotations

import asyncio

from dora_megatron.config.schema import load_config
from dora_megatron.controller.clients import EngineClients
from dora_megatron.controller.main import drive

from tests.helpers.runtime import make


def test_the_waits_counted_after_the_hand_off_are_in_the_summary(tmp_path):
    clients = EngineClients(load_config(None, []), tmp_path, tmp_path, None, 3, None)
    rt, _, _ = make(steps=2)
    rt.connection_waits = clients.connection_waits  # as controller.main hands it over
    clients.waits.add(2)  # calls that waited for a pooled connection during the run
    clients.waits.add()
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert summary["connection_waits"] == 3


def test_a_runtime_without_pooled_clients_counts_none(tmp_path):
    rt, _, _ = make(steps=2)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert summary["connection_waits"] == 0
