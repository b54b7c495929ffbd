"""Forming the weight-update group fails at the first rank that cannot join, instead of leaving the
others to wait out their group timeout (the trainer's default is 600 s; a CI run hung on exactly
this: the trainer's side refused a group name its process already had, and its instances waited)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dora_megatron.comm import weight_group
from dora_megatron.ports import free_port
from dora_megatron.weights.distributed import DistributedWeightPusher
from dora_megatron.weights.results import PushError


class Instance:
    """An update target whose join either hangs (a real instance waiting for the trainer's ranks)
    or is refused at once; it records what it was asked."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.joins: list[str] = []
        self.cancelled = False

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name="g", backend="gloo"):
        self.joins.append(group_name)
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return {}

    async def destroy_weights_update_group(self, group_name="g"):
        return {}


def pusher(targets, name, port=None, timeout_s=600.0):
    return DistributedWeightPusher(targets, master_address="127.0.0.1", master_port=port or free_port(),
                                   group_name=name, backend="gloo", timeout_s=timeout_s)


def test_a_group_name_this_process_already_has_is_refused_before_any_instance_is_asked():
    taken = weight_group.init_weight_update_group("127.0.0.1", free_port(), 0, 1, "dora-taken", "gloo", 30)
    try:
        inst = Instance()
        with pytest.raises(PushError) as err:
            asyncio.run(asyncio.wait_for(pusher({"e0": inst}, "dora-taken").connect(), 60))
        assert "already has a process group named 'dora-taken'" in err.value.errors["trainer"]
        assert inst.joins == []
    finally:
        weight_group.destroy_weight_update_group(taken)
    assert not weight_group.group_name_in_use("dora-taken")


def test_when_the_trainer_cannot_host_the_store_the_waiting_instances_are_let_go():
    with socket.socket() as busy:  # the store's port is taken by someone else
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        waiting = Instance()
        p = pusher({"e0": waiting}, "dora-port-taken", port=busy.getsockname()[1])
        with pytest.raises(PushError) as err:
            # far sooner than the 600-s group timeout the instance would otherwise wait out
            asyncio.run(asyncio.wait_for(p.connect(), 120))
    assert waiting.joins == ["dora-port-taken"] and waiting.cancelled
    assert set(err.value.errors) == {"trainer", "e0"} and "another rank could not join" in err.value.errors["e0"]
    assert p.group is None and p.joined == []


def test_an_instance_that_refuses_to_join_fails_the_connect_without_waiting_for_the_group_timeout():
    refusing, waiting = Instance(refuse="no such backend"), Instance()
    p = pusher({"e0": refusing, "e1": waiting}, "dora-refused")
    with pytest.raises(PushError) as err:
        asyncio.run(asyncio.wait_for(p.connect(), 120))
    assert "no such backend" in err.value.errors["e0"] and waiting.cancelled
    assert "trainer" not in err.value.errors  # its side was still waiting for the missing ranks: abandoned
    assert p.group is None and p.joined == []
