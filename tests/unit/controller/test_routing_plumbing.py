"""Routing replay plumbing: the runtime asks engines for routed experts only when configured, hands
them to the trainer with each sample (also across migrations and partial-mode resubmits), the
journal keeps them for a resume (with batch files: where the spool holds them, read back from it
on resume), summary.json aggregates the agreement, SGLang gets its flag."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.schema import load_config
from dora_megatron.controller.journal import Journal, JournaledSample, read_journal
from dora_megatron.controller.main import drive
from dora_megatron.observability.routing import routing_summary
from dora_megatron.comm.routed_experts import decode_routed_experts, encode_routed_experts
from dora_megatron.comm.routed_spool import SPOOL_DIR, RoutedSpool, SpoolError, SpooledRouted
from dora_megatron.comm.train_sample import routed_text
from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv

from tests.helpers.fakes import FakeEngine, FakeTrainer
from tests.helpers.runtime import check_run, ck_dir, make, resume


def _routing_of(ids: list[int]) -> str:
    """A routing the fake engine 'used': one layer, top-2 = (token id, position) per fed position."""
    return encode_routed_experts([v for p, t in enumerate(ids[:-1]) for v in (t, p)])


class RoutingEngine(FakeEngine):
    """FakeEngine that answers meta_info.routed_experts over prompt + output when asked."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.asked: list[bool] = []

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       routed_experts=False):
        self.asked.append(routed_experts)
        resp = await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                      version=version)
        return self._with_routing(resp, list(input_ids), routed_experts)

    async def import_request(self, blob: bytes):
        import pickle

        d = pickle.loads(blob)
        resp = await super().import_request(blob)
        return self._with_routing(resp, d["input_ids"], True)

    @staticmethod
    def _with_routing(resp, input_ids, asked):
        meta = {"routed_experts": _routing_of(input_ids + resp.output_ids)} if asked else {}
        return SimpleNamespace(**{**vars(resp), "raw": {"meta_info": meta}})


def _run(mode: str, routed: bool):
    rt, engines, trainer = make(mode=mode, n=3, steps=4, algo=AlgoConfig(routing_replay=routed))
    fakes = {name: RoutingEngine(name, token_s=0.001) for name in engines}
    rt.engines.clear()
    rt.engines.update(fakes)
    summary = asyncio.run(drive(rt))
    return rt, fakes, trainer, summary


def test_samples_carry_the_engines_routing_for_prompt_and_response():
    for mode in ("dora", "partial"):
        rt, engines, trainer, _ = _run(mode, True)
        if mode == "dora":  # (partial mode re-tags resubmitted samples: C1 does not hold there)
            check_run(rt, engines, trainer, 4, 4, 2)
        for batch in trainer.batches:
            for s in batch:
                ids = [*s.prompt_ids, *s.response_ids]
                rows = decode_routed_experts(routed_text(s.routed_experts), num_layers=1, top_k=2)
                assert rows == [[[t, p]] for p, t in enumerate(ids[:-1])], mode
        assert all(a for e in engines.values() for a in e.asked)


def test_off_by_default_nothing_is_requested_or_sent():
    rt, engines, trainer, _ = _run("dora", False)
    assert not any(a for e in engines.values() for a in e.asked)
    assert all(s.routed_experts is None for b in trainer.batches for s in b)


def test_journal_keeps_routed_experts_for_resume(tmp_path):
    j = Journal(tmp_path)
    j.start(3)
    with_r = JournaledSample("s1", "g1", 3, 0, (5, 6), (-0.1, -0.2), 1.0, _routing_of([1, 5, 6]))
    without = JournaledSample("s2", "g1", 3, 0, (7,), (-0.3,), 0.0)
    j.sample(with_r, [3])
    j.sample(without, [3])
    j.close()
    back = read_journal(tmp_path, 3)
    assert back["s1"] == with_r and back["s2"].routed_experts is None


def test_summary_aggregates_agreement_and_replayed_steps():
    out = routing_summary([{"router_topk_agreement": 0.9, "routing_replay": 1.0}, {"routing_replay": 0.0},
                           {"router_topk_agreement": 0.7, "routing_replay": 1.0}])
    assert out["router_topk_agreement"] == 0.8 and out["router_topk_agreement_min"] == 0.7
    assert out["routing_replay_steps"] == 2
    assert routing_summary([{}])["router_topk_agreement"] is None


def test_sglang_gets_enable_return_routed_experts_when_replay_is_on():
    spec = InstanceSpec(name="s0", model_path="/m", host="0.0.0.0", port=30000, nccl_port=30001, base_gpu_id=0,
                        tp_size=1)
    for overrides, want in ((["algo.routing_replay=true"], True), (["algo.router_agreement=true"], True), ([], False)):
        cfg = load_config(None, ["rollout.engine=sglang", "rollout.device=cuda", *overrides])
        argv = server_argv(spec, cfg.sglang, cfg.rollout, cfg.algo.wants_routed_experts)
        assert ("--enable-return-routed-experts" in argv) == want, overrides


def _trained_by_sample_id(batches):
    """(sample id, trained sample) of every sample the trainer got: batches list a group's samples
    in order, and the runtime forgot the consumed groups' records, so the ids are rebuilt here."""
    for b in batches:
        per_group: dict[str, list] = {}
        for s in b:
            per_group.setdefault(s.group_id, []).append(s)
        for gid, ss in per_group.items():
            yield from zip((f"{gid}.{i}" for i in range(len(ss))), ss)


def _routed_make(steps, tmp_path, **kw):
    fakes = {name: RoutingEngine(name, token_s=0.001) for name in ("e0", "e1", "e2")}
    rt, _, trainer = make(mode="dora", steps=steps, tmp_path=tmp_path, algo=AlgoConfig(routing_replay=True),
                          engines=fakes, **kw)
    return rt, fakes, trainer


def test_resume_from_the_journal_trains_on_the_journaled_routing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rt, _, _ = _routed_make(4, tmp_path, journal=Journal(run_dir))
    rt.journal.start(None)
    asyncio.run(drive(rt))
    rt.journal.close()
    journaled = read_journal(run_dir, 2)
    assert journaled and all(j.routed_experts for j in journaled.values())

    rt2, engines2, trainer2 = _routed_make(6, tmp_path, resume_from=2, journal=Journal(run_dir))
    resume(rt2, trainer2, tmp_path, 2)
    rt2.replay.load(journaled)
    rt2.journal.start(2)
    asyncio.run(drive(rt2))
    rt2.journal.close()
    generated = {rid for e in engines2.values() for op, rid, _ in e.log if op == "generate"}
    restored = 0
    for sid, s in _trained_by_sample_id(trainer2.batches):
        assert routed_text(s.routed_experts) == _routing_of([*s.prompt_ids, *s.response_ids])
        if sid in journaled and sid not in generated:
            assert routed_text(s.routed_experts) == journaled[sid].routed_experts
            restored += 1
    assert restored > 0


def test_sglang_adapter_forwards_the_routed_experts_request():
    from dora_megatron.comm.protocol import GenerateResponse
    from dora_megatron.rollout.sglang.engine import SGLangEngine

    class Client:
        base_url = "http://x"

        def __init__(self):
            self.kw = []

        async def supports(self, name):
            return False

        async def generate(self, input_ids, sampling_params=None, **kw):
            self.kw.append(kw)
            return GenerateResponse("r#", [1], {"type": "stop"}, 1, 1, "0")

    client = Client()
    eng = SGLangEngine(client)
    asyncio.run(eng.generate([1, 2], {}, rid="r", routed_experts=True))
    asyncio.run(eng.generate([1, 2], {}, rid="r"))
    assert [k["routed_experts"] for k in client.kw] == [True, False]


class SpoolReadingTrainer(FakeTrainer):
    """FakeTrainer that reads each sample's spooled routed experts from the spool's files as a
    trainer rank does (a missing or short segment fails the step), then hands them back to the
    spool as trained, as :meth:`TrainerClient.train` does."""

    def __init__(self, spool: RoutedSpool, engines: dict) -> None:
        super().__init__(engines=engines)
        self.spool = spool

    async def train(self, step: int, samples: list) -> dict:
        self.spool.flush()
        refs = [s.routed_experts for s in samples if isinstance(s.routed_experts, SpooledRouted)]
        read = []
        for s in samples:
            ref = s.routed_experts
            if isinstance(ref, SpooledRouted):
                ids = np.fromfile(self.spool.dir / ref.file, dtype=ref.dtype, count=ref.count, offset=ref.offset)
                assert ids.size == ref.count, (ref, ids.size)
                s = dataclasses.replace(s, routed_experts=ids)
            read.append(s)
        answer = await super().train(step, read)
        self.spool.retire(refs)
        return answer


def _spooled_make(steps: int, tmp_path, spool_dir, **kw):
    fakes = {name: RoutingEngine(name, token_s=0.001) for name in ("e0", "e1", "e2")}
    spool = RoutedSpool(spool_dir, segment_bytes=512)  # small segments: several per step, some freed
    trainer = SpoolReadingTrainer(spool, fakes)
    rt, _, _ = make(mode="dora", steps=steps, tmp_path=tmp_path, algo=AlgoConfig(routing_replay=True),
                    engines=fakes, trainer=trainer, **kw)
    rt.store.routed_spool = spool
    return rt, fakes, trainer, spool


def _named(tmp_path, run_dir, versions) -> set[str]:
    """The segments checkpoints ``versions`` and their journal tails name."""
    out = set()
    for v in versions:
        state = json.loads((ck_dir(tmp_path, v) / "controller.json").read_text())
        out |= {s["routed_at"][0] for s in state["samples"] if "routed_at" in s}
        out |= {j.routed_experts.file for j in read_journal(run_dir, v).values()}
    return out


def test_a_resume_after_a_kill_trains_the_routing_its_checkpoint_and_journal_name_in_the_spool(tmp_path):
    """Routing replay with the spool: checkpoints and the journal record where each sample's routed
    experts are (no ids); after the job is killed a resume from v2 reads them back from the spool
    (a sample finished before v2 and trained after it is not generated again, and trains exactly
    the routing it finished with), segments no loadable checkpoint names go during the run, and a
    resume whose checkpoint names a missing segment is refused naming the sample and the file."""
    run_dir, spool_dir = tmp_path / "run", tmp_path / "batches" / SPOOL_DIR
    run_dir.mkdir()
    rt, _, _, spool = _spooled_make(4, tmp_path, spool_dir, journal=Journal(run_dir))
    rt.journal.start(None)
    asyncio.run(drive(rt))
    rt.journal.close()
    spool.flush()  # the job is killed here: nothing closes the spool
    state2 = json.loads((ck_dir(tmp_path, 2) / "controller.json").read_text())
    from_ck = {s["sample_id"]: s["routed_at"] for s in state2["samples"] if "routed_at" in s}
    assert from_ck and not any("routed_experts" in s for s in state2["samples"])  # locations, not ids
    journaled = read_journal(run_dir, 2)
    assert journaled and all(isinstance(j.routed_experts, SpooledRouted) for j in journaled.values())

    broken = tmp_path / "broken" / SPOOL_DIR
    shutil.copytree(spool_dir, broken)
    gone = min(at[0] for at in from_ck.values())
    (broken / gone).unlink()
    sid = next(sid for sid, at in from_ck.items() if at[0] == gone)  # the first of the checkpoint's samples in it
    rt_x, _, trainer_x, spool_x = _spooled_make(6, tmp_path, broken, resume_from=2)
    with pytest.raises(SpoolError, match=rf"sample {sid} of the checkpoint: .*{broken / gone} is missing"):
        resume(rt_x, trainer_x, tmp_path, 2)
    spool_x.close()

    rt2, engines2, trainer2, spool2 = _spooled_make(6, tmp_path, spool_dir, resume_from=2, journal=Journal(run_dir))
    resume(rt2, trainer2, tmp_path, 2)
    rt2.replay.load(read_journal(run_dir, 2))
    rt2.journal.start(2)
    spool2.resumed()
    asyncio.run(drive(rt2))
    rt2.journal.close()
    generated = {rid for e in engines2.values() for op, rid, _ in e.log if op == "generate"}
    from_checkpoint = 0
    for sid, s in _trained_by_sample_id(trainer2.batches):
        assert routed_text(s.routed_experts) == _routing_of([*s.prompt_ids, *s.response_ids])
        from_checkpoint += sid in from_ck and sid not in generated
    assert from_checkpoint > 0
    written = int(max(p.name for p in spool_dir.glob("routed_*.bin"))[7:13]) + 1
    spool2.close()  # the run's end: only what its last two checkpoints (and their journal tails) name stays
    left = {p.name for p in spool_dir.glob("routed_*.bin")}
    assert left <= _named(tmp_path, run_dir, (4, 6)) and len(left) < written


def test_a_checkpoint_is_not_completed_when_the_spool_could_not_write_the_routing_it_names(tmp_path):
    """The checkpoint's writer waits for the spool's queued writes before controller.json: a write
    that failed (here the spool's directory is a file) fails the run instead of completing a
    checkpoint whose samples name ids that are not on disk."""
    rt, engines, _ = make(mode="dora", steps=4, tmp_path=tmp_path, algo=AlgoConfig(routing_replay=True))
    fakes = {name: RoutingEngine(name, token_s=0.001) for name in engines}
    rt.engines.clear()
    rt.engines.update(fakes)
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("the spool's directory should be here")
    rt.store.routed_spool = spool = RoutedSpool(blocker)
    with pytest.raises(OSError):
        asyncio.run(drive(rt))
    assert not (ck_dir(tmp_path, 2) / "controller.json").exists() and (ck_dir(tmp_path, 2)).is_dir()
    spool.close()
