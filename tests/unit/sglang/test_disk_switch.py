"""A disk switch whose post-update flush SGLang refuses: real 0.5.23 still counted a request as
running just after every answer was in, loaded the weights, refused the flush with a 400, and the
instance was restarted as failed (a 200-step CPU run, 3 restarts in 60 steps)."""

from __future__ import annotations

import asyncio

import pytest

from dora_megatron.comm.engine_client import EngineError
from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.rollout.sglang import engine as sglang_engine
from dora_megatron.rollout.sglang.engine import SGLangEngine

REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
           "Retract or finish them, then call /flush_cache.")


class Server(SGLangClient):
    """An SGLang whose scheduler stays busy for ``busy_flushes`` flush attempts after the update."""

    def __init__(self, busy_flushes: int, update_error: str = REFUSED) -> None:
        super().__init__("http://sglang.invalid")
        self.busy_flushes = busy_flushes
        self.update_error = update_error
        self.flushes = 0
        self.loaded: list[tuple[str, str]] = []

    async def update_weights_from_disk(self, model_path, weight_version=None, **kw):
        self.loaded.append((model_path, str(weight_version)))
        raise EngineError(self.base_url + "/update_weights_from_disk", 400, self.update_error)

    async def flush_cache(self) -> bool:
        self.flushes += 1
        return self.flushes > self.busy_flushes


def test_a_refused_flush_after_a_loaded_update_is_retried_until_the_scheduler_is_idle():
    server = Server(busy_flushes=3)
    out = asyncio.run(SGLangEngine(server).update_weights_from_disk("/snap/v7", weight_version=7))
    assert out["success"] and server.loaded == [("/snap/v7", "7")] and server.flushes == 4


def test_a_flush_refused_for_longer_than_the_bound_fails_the_switch_with_sglangs_message(monkeypatch):
    monkeypatch.setattr(sglang_engine, "FLUSH_RETRY_S", 0.3)
    server = Server(busy_flushes=10**6)
    with pytest.raises(EngineError, match="cache was not flushed"):
        asyncio.run(SGLangEngine(server).update_weights_from_disk("/snap/v7", weight_version=7))
    assert server.flushes >= 1


def test_any_other_refused_update_is_not_retried():
    server = Server(busy_flushes=0, update_error="Failed to get weights iterator: /snap/v7 not found")
    with pytest.raises(EngineError, match="not found"):
        asyncio.run(SGLangEngine(server).update_weights_from_disk("/snap/v7", weight_version=7))
    assert server.flushes == 0
