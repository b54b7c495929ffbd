"""The trainer service's ``/push_weights`` route: validation, dispatch to the worker, client call."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from dora_megatron.controller.trainer_client import TrainerClient, TrainerError
from dora_megatron.trainer.service import (BadRequest, CheckpointBody, Command, TrainerService, validate_checkpoint,
                                           validate_push)


class FakeWorker:
    version = 3

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def push_weights(self, engines, bucket_mb, master_addr, timeout_s, gpus=None, pause_mode=None, master_port=None,
                     backend=None):
        self.calls.append((engines, bucket_mb, master_addr, timeout_s, gpus, pause_mode, master_port, backend))
        return {"bytes": 10, "versions": {u: str(self.version) for u in engines}, "checksum": "abc"}


@pytest.mark.parametrize("payload, msg", [
    ({"bucket_mb": 1}, "engines"),
    ({"engines": [], "bucket_mb": 1}, "engines"),
    ({"engines": ["http://a"], "bucket_mb": 0}, "bucket_mb"),
    ({"engines": ["http://a"], "bucket_mb": True}, "bucket_mb"),
    ({"engines": ["http://a"], "bucket_mb": 1, "timeout_s": -1}, "timeout_s"),
    ({"engines": ["http://a"], "bucket_mb": 1, "master_addr": 5}, "master_addr"),
    ({"engines": ["http://a"], "bucket_mb": 1, "gpus": {"http://a": 0}}, "gpus"),
    ({"engines": ["http://a"], "bucket_mb": 1, "gpus": [2]}, "gpus"),
    ({"engines": ["http://a"], "bucket_mb": 1, "gpus": {"http://b": 2}}, "http://b"),
    ({"engines": ["http://a"], "bucket_mb": 1, "pause_mode": "drain"}, "pause_mode"),
    ({"engines": ["http://a"], "bucket_mb": 1, "master_port": 70000}, "master_port"),
    ({"engines": ["http://a"], "bucket_mb": 1, "master_port": "29700"}, "master_port"),
    ({"engines": ["http://a"], "bucket_mb": 1, "backend": "mpi"}, "backend"),
])
def test_validate_push_rejects(payload, msg):
    with pytest.raises(BadRequest, match=msg):
        validate_push(payload)


@pytest.mark.parametrize("payload, message", [
    ({"engines": [""], "bucket_mb": 1}, "engines[0] must be a string of length >= 1, got ''"),
    ({"engines": ["http://a"], "bucket_mb": True}, "bucket_mb must be a number, got True"),
    ({"engines": ["http://a"], "bucket_mb": float("nan")}, "bucket_mb must be > 0.0, got nan"),
    ({"engines": ["http://a"], "bucket_mb": 1, "master_addr": None}, "master_addr must be a string, got None"),
    ({"engines": ["http://a"], "bucket_mb": 1, "master_port": "29700"}, "master_port must be an integer, got '29700'"),
    ({"engines": ["http://a"], "bucket_mb": 1, "timeout_s": 0}, "timeout_s must be > 0.0, got 0"),
    ({"engines": ["http://a"], "bucket_mb": 1, "gpus": {"http://a": True}}, "gpus[...] must be an integer, in {'http://a': True}"),
])
def test_validate_push_names_the_field_and_value(payload, message):
    with pytest.raises(BadRequest) as e:
        validate_push(payload)
    assert str(e.value) == message


def test_validate_push_accepts_nulls_for_the_optional_fields():
    validate_push({"engines": ["http://a"], "bucket_mb": 0.5, "backend": None, "master_port": None, "timeout_s": None,
                   "gpus": None, "pause_mode": None})
    validate_push({"engines": ["http://a"], "bucket_mb": 8, "backend": "nccl", "master_port": 29700, "timeout_s": 30,
                   "gpus": {"http://a": 2}, "pause_mode": "in_place", "master_addr": "10.0.0.1"})


@pytest.mark.parametrize("payload, message", [
    ({}, "missing field path"), ({"path": 5}, "path must be a string, got 5"), ({"path": None}, "path must be a string, got None"),
])
def test_a_checkpoint_command_names_a_bad_path(payload, message):
    with pytest.raises(BadRequest) as e:
        validate_checkpoint(payload)
    assert str(e.value) == message
    assert validate_checkpoint({"path": "/run/ckpt/3", "extra": 1}) == CheckpointBody("/run/ckpt/3")


def test_execute_dispatches_with_defaults():
    w = FakeWorker()
    svc = TrainerService(w, run_dir=".", rank=0, world_size=1)
    out = svc.execute(Command("push_weights", validate_push({"engines": ["http://e1"], "bucket_mb": 8})))
    assert out["versions"] == {"http://e1": "3"}
    assert w.calls == [(["http://e1"], 8.0, "127.0.0.1", 120.0, None, None, None, None)]


def test_a_follower_executes_the_typed_push_it_receives_pickled():
    """The other ranks get each command by ``broadcast_object_list`` (pickle): the typed body
    arrives whole and runs with the same arguments; a body of another command is refused."""
    import pickle

    cmd = Command("push_weights", validate_push({"engines": ["http://e1", "http://e2"], "bucket_mb": 2, "timeout_s": 9,
                                                 "gpus": {"http://e2": 2}, "pause_mode": "abort", "master_port": 29701,
                                                 "backend": "gloo", "master_addr": "10.1.1.1"}))
    w = FakeWorker()
    TrainerService(w, run_dir=".", rank=1, world_size=2).execute(pickle.loads(pickle.dumps(cmd)))
    assert w.calls == [(["http://e1", "http://e2"], 2.0, "10.1.1.1", 9.0, {"http://e2": 2}, "abort", 29701, "gloo")]
    with pytest.raises(BadRequest, match="command 'push_weights' takes a PushBody body, got CheckpointBody"):
        TrainerService(w, run_dir=".", rank=0, world_size=1).execute(Command("push_weights", CheckpointBody("/x")))


def test_http_route_and_client():
    w = FakeWorker()
    svc = TrainerService(w, run_dir=".", rank=0, world_size=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = threading.Thread(target=svc.leader_loop, args=("127.0.0.1", port), daemon=True)
    t.start()

    async def go():
        c = TrainerClient(f"http://127.0.0.1:{port}")
        try:
            while await c.health() is None:
                await asyncio.sleep(0.02)
            with pytest.raises(TrainerError, match="400"):
                await c.push_weights(["http://e"], -1)
            return await c.push_weights(["http://e1", "http://e2"], 16, master_addr="10.0.0.1", timeout_s=30,
                                        gpus={"http://e2": 4}, pause_mode="retract", master_port=29700,
                                        backend="gloo")
        finally:
            await c.shutdown()
            await c.close()

    reply = asyncio.run(go())
    t.join(timeout=10)
    assert reply["checksum"] == "abc"
    # the 400 never reached the worker
    assert w.calls == [(["http://e1", "http://e2"], 16.0, "10.0.0.1", 30.0, {"http://e2": 4}, "retract", 29700,
                        "gloo")]
