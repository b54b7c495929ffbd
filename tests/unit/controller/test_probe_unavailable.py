"""A weights check that cannot run is not a failed instance: an SGLang instance whose
``/weights_checker`` answers 404, 405, 501 or refuses the checksum action (a build or launch mode
without it) keeps serving through every ``distributed`` push, with one warning and the check off
for it (``checksum_unavailable``), while an instance whose checksum *differs* is still failed.
The same for the other optional probes: no load report (``/v1/loads``), no ``routed_experts``.

The checks go over HTTP to a fake SGLang route, through the real :class:`SGLangClient`, so the
classification of the replies is the production one."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dora_megatron.comm.sglang_client import SGLangClient
from dora_megatron.config.algo import AlgoConfig
from dora_megatron.controller.main import drive

from tests.helpers.runtime import make

from tests.helpers.fakes import FakeEngine, FakeTrainer

#: how each unavailable check answers (status, JSON body), as servers without the route or action do
UNAVAILABLE = {
    "404": (404, {"detail": "Not Found"}),
    "405": (405, {"detail": "Method Not Allowed"}),
    "501": (501, {"message": "weights_checker is not implemented for this backend"}),
    # SGLang's WeightChecker.handle raises ``Unsupported action=...``; http_server answers 400 with it
    "unsupported-action": (400, {"success": False, "message": "Unsupported action='checksum'"}),
}


class CheckerEngine(FakeEngine):
    """A fake instance whose ``instance_checksum`` asks a fake SGLang ``/weights_checker`` over HTTP.
    ``checker``: ``"ok"`` (the checksum of the weights held), ``"bad"`` (other weights after a push),
    ``"500"`` (the checker itself broke), or a key of :data:`UNAVAILABLE`."""

    def __init__(self, name: str, checker: str, **kw) -> None:
        super().__init__(name, **kw)
        self.checker = checker
        self.checker_calls = 0
        self.last_load = "disk"
        self.server: TestServer | None = None
        self.client: SGLangClient | None = None

    async def start(self) -> None:
        async def weights_checker(request: web.Request) -> web.Response:
            self.checker_calls += 1
            if self.checker in UNAVAILABLE:
                status, body = UNAVAILABLE[self.checker]
                return web.json_response(body, status=status)
            if self.checker == "500":  # the route exists and broke: not "cannot run here"
                return web.json_response({"message": "CUDA error: an illegal memory access"}, status=500)
            bad = self.checker == "bad" and self.last_load == "push"
            return web.json_response({"success": True, "message": "ok",
                                      "per_engine_checksum": "corrupt" if bad else f"sum-v{self.version}"})

        app = web.Application()
        app.router.add_post("/weights_checker", weights_checker)
        self.server = TestServer(app)
        await self.server.start_server()
        self.client = SGLangClient(str(self.server.make_url("")).rstrip("/"), timeout_s=10)

    async def stop(self) -> None:
        await self.client.close()
        await self.server.close()

    async def update_weights_from_disk(self, model_path: str, weight_version=None):
        self.last_load = "disk"
        return await super().update_weights_from_disk(model_path, weight_version)

    async def instance_checksum(self) -> str:
        return await self.client.instance_checksum()


class PushTrainer(FakeTrainer):
    async def push_weights(self, engines, *args, **kwargs):
        out = await super().push_weights(engines, *args, **kwargs)
        for url in engines:
            self.engines[url].last_load = "push"
        return out


def _run(checkers: dict[str, str], steps: int = 5):
    engines = {n: CheckerEngine(n, checkers[n], token_s=0.001) for n in checkers}
    trainer = PushTrainer(engines=engines)
    rt, _, _ = make(mode="dora", steps=steps, transport="distributed", engines=engines, trainer=trainer)

    async def go():
        for e in engines.values():
            await e.start()
        try:
            return await asyncio.wait_for(drive(rt), timeout=120)
        finally:
            for e in engines.values():
                await e.stop()

    return rt, engines, trainer, asyncio.run(go())


@pytest.mark.parametrize("reply", sorted(UNAVAILABLE))
def test_an_instance_whose_checksum_cannot_run_survives_every_push(reply, caplog):
    caplog.set_level(logging.WARNING, logger="dora_megatron.controller.runtime")
    rt, engines, trainer, summary = _run({"e0": "ok", "e1": "ok", "e2": reply})
    pushes_to_e2 = sum(engines["e2"].base_url in urls for _, urls in trainer.pushes)
    assert pushes_to_e2 >= 2, f"e2 got {pushes_to_e2} pushes: the test needs several"
    assert "e2" not in rt.pool.failed and summary["failed_instances"] == []
    assert summary["checksum_unavailable"] == 1 and summary["checksum_mismatches"] == 0
    assert engines["e2"].checker_calls == 1, "the check was not switched off after it could not run"
    assert engines["e0"].checker_calls >= 2  # the others are still checked after every push
    warnings = [r for r in caplog.records if "checksum_unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "e2" in warnings[0].getMessage()
    assert len(trainer.batches) == 5 and summary["lost_groups"] == 0


def test_a_differing_checksum_still_fails_the_instance_next_to_an_unavailable_one():
    rt, engines, trainer, summary = _run({"e0": "ok", "e1": "404", "e2": "bad"})
    assert "e2" in rt.pool.failed and "e1" not in rt.pool.failed and "e0" not in rt.pool.failed
    assert summary["checksum_mismatches"] >= 1 and summary["checksum_unavailable"] == 1
    assert summary["lost_groups"] == 0


def test_a_checker_that_fails_otherwise_still_fails_the_instance():
    """A 500 is not "cannot run here": the instance answered, and wrongly."""
    rt, engines, trainer, summary = _run({"e0": "ok", "e1": "ok", "e2": "500"})
    assert engines["e2"].checker_calls >= 1, "e2 was never checked"
    assert summary["failed_instances"] == ["e2"] and summary["checksum_unavailable"] == 0


class NoLoadsEngine(FakeEngine):
    """An instance without ``/v1/loads``: alive (``/health``), no load report (SGLangClient.server_info)."""

    async def server_info(self):
        self._check()
        return {"loads_unavailable": True}


def test_an_instance_without_a_load_report_keeps_serving():
    engines = {"e0": FakeEngine("e0", token_s=0.001), "e1": NoLoadsEngine("e1", token_s=0.001)}
    rt, _, _ = make(mode="dora", steps=4, engines=engines)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert summary["failed_instances"] == [] and summary["lost_groups"] == 0
    assert any(op == "generate" for op, _, _ in engines["e1"].log), "e1 got no work"


class RoutingEngine(FakeEngine):
    """Answers with ``meta_info.routed_experts`` when asked, unless ``routing`` is off (an SGLang
    launched without ``--enable-return-routed-experts`` leaves them out). No KV migration: an
    imported request would answer through ``import_request``, which this fake does not wrap."""

    def __init__(self, name: str, routing: bool, **kw) -> None:
        super().__init__(name, **kw)
        self.routing = routing

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       routed_experts=False):
        resp = await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                      version=version)
        meta = {"routed_experts": "BwAAAP////8="} if routed_experts and self.routing else {}  # int32 ids [7, -1]
        return SimpleNamespace(**{**vars(resp), "raw": {"meta_info": meta}})


def test_an_instance_answering_without_routed_experts_is_counted_not_failed(caplog):
    caplog.set_level(logging.WARNING, logger="dora_megatron.controller.runtime")
    engines = {"e0": RoutingEngine("e0", True, token_s=0.001, migration=False),
               "e1": RoutingEngine("e1", False, token_s=0.001, migration=False)}
    rt, _, _ = make(mode="dora", steps=4, algo=AlgoConfig(routing_replay=True), engines=engines)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    assert summary["failed_instances"] == [] and summary["routed_experts_unavailable"] == 1
    warnings = [r for r in caplog.records if "routed_experts_unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "e1" in warnings[0].getMessage()
    samples = [s for batch in rt.trainer.batches for s in batch]
    # e0's still reach the trainer, as compact arrays (2 experts' ids and -1 fit int8)
    assert any(s.routed_experts is not None and s.routed_experts.tolist() == [7, -1]
               and s.routed_experts.dtype.itemsize == 1 for s in samples)
