"""The runtime's SGLang-facing duties against fakes that answer as SGLang 0.5.23 does: an abort
that races the dispatch is retried until the generate returns, an answer that crossed a weight
update is recorded with every version that produced it, and weights are verified after a
``distributed`` push (the trainer's checksum on the embedded engine, SGLang's own checksum
compared between instances)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dora_megatron.events import EngineReply
from dora_megatron.controller.main import drive
from dora_megatron.controller.records import SampleRecord
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import running_sum_prompt
from dora_megatron.orchestrator.actions import Interrupt

from tests.helpers.fakes import FakeEngine, FakeTrainer
from tests.helpers.runtime import make


class LateRegisteringEngine(FakeEngine):
    """SGLang's abort: 200 whatever happened (returns True), and an abort of a rid the server has
    not registered yet is dropped; here a generate registers only after ``register_s``."""

    def __init__(self, name: str, register_s: float = 0.2, **kw) -> None:
        super().__init__(name, **kw)
        self.register_s = register_s
        self.aborts_sent = 0

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None):
        await asyncio.sleep(self.register_s)  # the /generate is still on its way
        return await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                      version=version)

    async def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        self.aborts_sent += 1
        await super().abort(rid, abort_all)
        return True


def test_interrupt_retries_an_abort_that_raced_the_dispatch():
    rt, _, _ = make(mode="partial", n=1, steps=1)
    engine = LateRegisteringEngine("e0", token_s=0.02)
    rt.engines["e0"] = engine
    prompt = tok.encode(running_sum_prompt([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), add_bos=True)  # a 21-token answer

    async def go():
        prev = asyncio.create_task(engine.generate(prompt, rid="s1"))
        await asyncio.sleep(0)  # the generate is dispatched, not yet registered
        await asyncio.wait_for(rt.moves.abort(Interrupt("s1", "e0"), prev), timeout=30)
        return prev.result()

    resp = asyncio.run(go())
    # the first abort was dropped (rid unknown yet); a retry aborted the running request
    assert engine.aborts_sent >= 2
    assert resp.finish_reason["type"] == "abort" and len(resp.output_ids) < 21


def test_an_answer_spanning_a_weight_update_records_every_version():
    rt, _, _ = make(mode="partial", n=1, steps=1)
    rec = SampleRecord("s1", "g1", 0, 1, [1, 2, 3])
    resp = SimpleNamespace(output_ids=[4, 5, 6], output_token_logprobs=[-0.1] * 3, finish_reason={"type": "abort"},
                           migrated=False, weight_version="2", versions_used=["1", "2"], token_arrays=None, raw={})
    rec.versions.add(1)
    rt.store.samples["s1"] = rec
    assert rt.absorb(EngineReply("s1", "e0", resp, 0.0, 0.0)) is None  # aborted: partial output kept
    assert rec.versions == {1, 2}
    assert rec.response_ids.tolist() == [4, 5, 6]


class ChecksumEngine(FakeEngine):
    """An embedded-style engine (trainer-comparable checksum) whose pushed weights may be wrong."""

    def __init__(self, name: str, bad_after_push: bool = False, **kw) -> None:
        super().__init__(name, **kw)
        self.bad_after_push = bad_after_push
        self.last_load = "disk"

    async def supports(self, name: str) -> bool:
        return name == "weights_checksum" or await super().supports(name)

    async def update_weights_from_disk(self, model_path: str, weight_version=None):
        self.last_load = "disk"
        return await super().update_weights_from_disk(model_path, weight_version)

    async def weights_checksum(self) -> str:
        if self.bad_after_push and self.last_load == "push":
            return "corrupt"
        return f"sum-v{self.version}"


class InstanceChecksumEngine(ChecksumEngine):
    """An SGLang-style engine: no trainer-comparable checksum, only ``/weights_checker``."""

    async def supports(self, name: str) -> bool:
        return await FakeEngine.supports(self, name)

    async def instance_checksum(self) -> str:
        return await self.weights_checksum()


class ChecksumTrainer(FakeTrainer):
    async def train(self, step, samples):
        out = await super().train(step, samples)
        return {**out, "checksum": f"sum-v{out['version']}"}

    async def push_weights(self, engines, *args, **kwargs):
        out = await super().push_weights(engines, *args, **kwargs)
        for url in engines:
            self.engines[url].last_load = "push"
        return {**out, "checksum": f"sum-v{out['version']}"}


def _run_with(engine_cls):
    engines = {n: engine_cls(n, bad_after_push=(n == "e2"), token_s=0.001) for n in ("e0", "e1", "e2")}
    trainer = ChecksumTrainer(engines=engines)
    rt, _, _ = make(mode="dora", steps=4, transport="distributed", engines=engines, trainer=trainer)
    summary = asyncio.run(drive(rt))
    return rt, trainer, summary


def test_distributed_push_compares_the_trainer_checksum_and_fails_a_mismatching_instance():
    rt, trainer, summary = _run_with(ChecksumEngine)
    assert any("e2" in [u.split("//")[-1] for u in urls] for _, urls in trainer.pushes), "e2 never got a push"
    assert summary["checksum_mismatches"] >= 1
    assert "e2" in rt.pool.failed and not {"e0", "e1"} & rt.pool.failed
    assert summary["lost_groups"] == 0


def test_sglang_instances_are_compared_with_each_other_after_a_push():
    rt, trainer, summary = _run_with(InstanceChecksumEngine)
    assert summary["checksum_mismatches"] >= 1
    assert rt.pool.failed, "an instance reporting other weights than its peers on the same version stayed in the pool"
    assert summary["lost_groups"] == 0


class PausableEngine(FakeEngine):
    """SGLang's pause: held until ``/continue_generation``; a disk update leaves it paused."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.paused = False
        self.resumed = asyncio.Event()

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None):
        while self.paused:
            await self.resumed.wait()
        return await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                      version=version)

    async def continue_generation(self) -> dict:
        self.paused = False
        self.resumed.set()
        return {"status": "ok"}


class PausingFailedPushTrainer(FakeTrainer):
    """A push that paused the instances, then failed before it could resume them (the trainer
    died mid-push, say): the runtime falls back to the snapshot."""

    async def push_weights(self, engines, *args, **kwargs):
        for url in engines:
            self.engines[url].paused = True
            self.engines[url].resumed.clear()
        raise RuntimeError("broadcast failed: peer gone")


def test_the_snapshot_fallback_after_a_failed_push_resumes_the_instance():
    engines = {n: PausableEngine(n, token_s=0.001) for n in ("e0", "e1")}
    rt, _, _ = make(mode="dora", steps=3, transport="distributed", engines=engines,
                    trainer=PausingFailedPushTrainer(engines=engines))
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=60))  # paused instances: every generate would wait
    assert len(rt.trainer.batches) == 3 and summary["lost_groups"] == 0
    assert all(e.loads for e in engines.values()), "the fallback loads the snapshot"
    assert not any(e.paused for e in engines.values())
