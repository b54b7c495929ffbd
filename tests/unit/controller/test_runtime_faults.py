"""Runtime fault handling against fakes: a failed instance rejoining, a weight sync that never
ends, switch orders that overtake each other, a push of newer weights than assigned, checkpoint
manifests, and finished samples restored from the write-ahead journal on resume.

All must keep C1-C3 (requests of a failed instance re-run on their own version; nothing lost or
trained twice) and the runs must finish every step.
"""

from __future__ import annotations

import asyncio

from dora_megatron.config.controller import ControllerConfig
from dora_megatron.controller.main import drive

from tests.helpers.fakes import FakeEngine, fail_after_first_step
from tests.helpers.runtime import check_run, ck_dir, make, resume


async def execute_with_loop(rt, actions) -> None:
    """Execute ``actions`` while a :class:`ControllerLoop` applies what their tasks report, until
    every task ended (the tasks wait for their events to be applied)."""
    from dora_megatron.controller.loop import ControllerLoop

    loop = asyncio.get_running_loop().create_task(ControllerLoop(rt.orch, rt, rt.events, rt.tasks.ended).run())
    rt.execute(actions)
    await asyncio.gather(*rt.tasks.running)
    rt.tasks.stop()
    await loop


def record_switches():
    """An orchestrator that only records ``on_switch_done`` calls, for :func:`make`'s
    ``orchestrator`` (it keeps the made one's config and policy, which the runtime is sized by),
    and the list of the calls."""
    done: list[tuple[str, int]] = []

    class Orch:
        def __init__(self, made):
            self.config, self.policy = made.config, made.policy

        def is_alive(self, instance):
            return True

        def on_switch_done(self, instance, version):
            done.append((instance, version))
            return []

    return Orch, done


def test_failed_instance_rejoins_and_serves_again():
    rt, engines, trainer = make(mode="dora", n=3, steps=10, token_s=0.003)
    replacement = FakeEngine("e1-restarted", token_s=0.003)
    trainer.hold_step(9, lambda: rt.pool.samples_after_rejoin > 0)

    async def main():
        async def kill_then_rejoin():
            await fail_after_first_step(rt, trainer, engines["e1"], "e1")
            # a stale failure report through the old client, after the rejoin, must be ignored
            old = rt.engines["e1"]
            rt.add_instance("e1", replacement)
            rt.report_failure("e1", "late error from the old process", engine=old)
        asyncio.get_running_loop().create_task(kill_then_rejoin())
        return await drive(rt)

    summary = asyncio.run(main())
    check_run(rt, {**engines, "e1-restarted": replacement}, trainer, 10, 4, 2)
    assert summary["failed_instances"] == ["e1"] and "e1" not in rt.pool.failed
    assert summary["instances_rejoined"] == 1
    assert summary["engine_restarts"] is None  # no supervising launcher here
    # it was switched to a version by the orchestrator, then generated and finished samples
    assert replacement.loads and any(op == "generate" for op, _, _ in replacement.log)
    assert summary["samples_after_rejoin"] > 0
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


class HangOnceEngine(FakeEngine):
    """The first load of a version >= 1 among all engines sharing ``budget`` never finishes."""

    def __init__(self, name: str, budget: dict, **kw) -> None:
        super().__init__(name, **kw)
        self.budget = budget
        self.stuck = False

    async def update_weights_from_disk(self, model_path: str, weight_version=None):
        if int(weight_version) >= 1 and self.budget["hangs"] > 0:
            self.budget["hangs"] -= 1
            self.stuck = True
            await asyncio.sleep(3600)
        return await super().update_weights_from_disk(model_path, weight_version)


def test_weight_sync_timeout_fails_the_instance_and_training_continues():
    rt, engines, trainer = make(mode="dora", n=3, steps=6, token_s=0.002,
                                controller=ControllerConfig(weight_sync_timeout_s=0.2))
    budget = {"hangs": 1}
    for name in list(engines):
        engines[name] = rt.engines[name] = HangOnceEngine(name, budget, token_s=0.002)
    trainer.hold_step(5, lambda: rt.weights.weight_sync_timeouts > 0)  # else the run may end first
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=60))
    check_run(rt, engines, trainer, 6, 4, 2)
    slow = [name for name, e in engines.items() if e.stuck]
    assert len(slow) == 1
    assert summary["failed_instances"] == slow and summary["weight_sync_timeouts"] == 1
    assert summary["steps"] == 6 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert summary["c1_violations"] == 0 and summary["c3_violations"] == 0
    # after it failed, nothing more was sent to it: it never ran a version >= 1
    assert all(version == 0 for _, _, version in engines[slow[0]].log)


class OutOfStepEngine(FakeEngine):
    """Serves version 9 whatever it is told to load (started on another checkpoint, a reload that
    does not take): every request routed for the version the controller believes it holds is refused."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.version = 9

    async def update_weights_from_disk(self, model_path: str, weight_version=None):
        out = await super().update_weights_from_disk(model_path, weight_version)
        self.version = 9
        return out


def test_an_instance_out_of_step_with_the_controller_is_failed_instead_of_refusing_for_ever():
    # no KV migration (SGLang's path): a migration to it is a resubmit, which it refuses too
    rt, engines, trainer = make(mode="dora", n=3, steps=4, token_s=0.002, migration=False)
    engines["e1"] = rt.engines["e1"] = OutOfStepEngine("e1", token_s=0.002, migration=False)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=60))
    check_run(rt, engines, trainer, 4, 4, 2)
    assert summary["failed_instances"] == ["e1"]
    assert summary["version_refusals"] >= 3 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
    assert not any(op == "generate" for op, _, _ in engines["e1"].log), "it never ran a request"


def test_only_the_newest_switch_order_of_an_instance_is_carried_out():
    """Re-targeted before its switch ran (v2, v0, v2): one load of v2, reported once; an earlier
    completion reported as ``v2`` would let v2 requests in before the queued v0 load."""
    from dora_megatron.orchestrator import SwitchVersion

    recording, done = record_switches()
    rt, engines, trainer = make(mode="dora", n=2, steps=1, orchestrator=recording)

    async def main():
        await execute_with_loop(rt, [SwitchVersion("e1", 2), SwitchVersion("e1", 0), SwitchVersion("e1", 2)])

    asyncio.run(main())
    assert engines["e1"].loads == [rt.weights.paths.snapshot_dir(2)] and engines["e1"].version == 2
    assert done == [("e1", 2)]


def test_checkpoints_carry_a_manifest_and_stale_ones_are_replaced(tmp_path):
    from dora_megatron.controller.checkpoint_manifest import MANIFEST, verify

    stale = ck_dir(tmp_path, 4)  # left by a crashed lineage: must not mix with the new checkpoint
    (stale / "trainer").mkdir(parents=True)
    (stale / "trainer" / "old_shard.distcp").write_bytes(b"old")
    (stale / "controller.json").write_text("{}")
    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path)
    asyncio.run(drive(rt))
    for ck in (ck_dir(tmp_path, 2), ck_dir(tmp_path, 4)):
        assert (ck / MANIFEST).is_file() and verify(ck) == []
    assert not (stale / "trainer" / "old_shard.distcp").exists()
    state = (ck_dir(tmp_path, 2) / "controller.json").read_text()
    (ck_dir(tmp_path, 2) / "controller.json").write_text(state.replace('"version"', '"versioX"', 1))
    assert any("controller.json" in p and "SHA-256" in p for p in verify(ck_dir(tmp_path, 2)))


def test_resume_restores_finished_samples_from_the_journal(tmp_path):
    """A lineage runs past checkpoint 2 (to 4); resuming from 2 restores the samples finished after
    it by versions <= 2 from the journal instead of generating them again; every group once."""
    import json

    from dora_megatron.controller.journal import JOURNAL, Journal, read_journal

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rt, engines, trainer = make(mode="dora", steps=4, tmp_path=tmp_path, journal=Journal(run_dir))
    rt.journal.start(None)
    asyncio.run(drive(rt))
    rt.journal.close()
    journaled = read_journal(run_dir, 2)
    assert journaled and all(j.version <= 2 for j in journaled.values())
    assert read_journal(run_dir, 1) == {}  # no marker for a version without a checkpoint
    first_two = [{s.group_id for s in b} for b in trainer.batches[:2]]

    rt2, engines2, trainer2 = make(mode="dora", steps=6, tmp_path=tmp_path, resume_from=2, journal=Journal(run_dir))
    resume(rt2, trainer2, tmp_path, 2)
    rt2.replay.load(journaled)
    rt2.journal.start(2)
    summary = asyncio.run(drive(rt2))
    rt2.journal.close()
    replayed = [json.loads(x) for x in (run_dir / "replayed.jsonl").read_text().splitlines()]
    assert summary["samples_from_journal"] == len(replayed) > 0
    generated = {rid for e in engines2.values() for op, rid, _ in e.log if op == "generate"}
    trained: dict[str, dict] = {}  # sample id -> what the trainer got (samples come in group order)
    for b in trainer2.batches:
        per_group: dict[str, list] = {}
        for s in b:
            per_group.setdefault(s.group_id, []).append(s)
        for gid, ss in per_group.items():
            trained.update(zip((f"{gid}.{i}" for i in range(len(ss))), ss))  # consumed: records forgotten
    for r in replayed:
        assert r["sample_id"] not in generated  # not regenerated
        s = trained.get(r["sample_id"])
        if s is not None:  # consumed in this lineage: trained on exactly the journaled tokens
            j = journaled[r["sample_id"]]
            assert list(s.response_ids) == list(j.response_ids) and list(s.rollout_logprobs) == list(j.rollout_logprobs)
            assert s.version == j.version
    assert any(r["sample_id"] in trained for r in replayed)
    # every group of the final lineage consumed once; the restored samples are right answers
    resumed = [{s.group_id for s in b} for b in trainer2.batches]
    all_groups = [g for b in first_two + resumed for g in b]
    assert len(all_groups) == len(set(all_groups)) == 6 * 4
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    for batch in trainer2.batches:
        for s in batch:
            assert s.reward == 1.0
    assert (run_dir / JOURNAL).is_file()


def test_a_push_of_newer_weights_than_assigned_falls_back_to_the_snapshot():
    """`distributed` transport: the trainer trained on while the push waited and sent v3 for an
    instance the orchestrator assigned v2; the instance must end on v2 (C1), from the snapshot."""
    from dora_megatron.orchestrator import SwitchVersion

    recording, done = record_switches()
    rt, engines, trainer = make(mode="dora", n=2, steps=1, transport="distributed", orchestrator=recording)
    rt.weights.latest_version = 2  # what the runtime knew when it chose the push
    trainer.version = 3  # what the trainer holds when the push runs

    async def main():
        await execute_with_loop(rt, [SwitchVersion("e1", 2)])

    asyncio.run(main())
    assert trainer.pushes == [(3, ["fake://e1"])]
    assert engines["e1"].version == 2 and engines["e1"].loads == [rt.weights.paths.snapshot_dir(2)]
    assert done == [("e1", 2)]


def test_a_run_started_without_an_instance_never_uses_it_until_it_joins():
    """The launcher starts without ``e2`` (failed at the start): nothing is dispatched to it; once it
    joins (its restarted process serves) it is switched to a version and serves; groups exactly once."""
    rt, engines, trainer = make(mode="dora", n=3, steps=8, token_s=0.003)
    replacement = FakeEngine("e2-restarted", token_s=0.003)
    dead = engines["e2"]  # the client of the process that died (``engines`` is the pool: replaced on join)
    rt.pool.start_without({"e2": "exited with status -9"})
    trainer.hold_step(7, lambda: rt.pool.samples_after_rejoin > 0)

    async def main():
        async def join_later():
            while len(trainer.batches) < 2:
                await asyncio.sleep(0.005)
            assert not dead.log, "work went to an instance that was not ready at the start"
            rt.add_instance("e2", replacement)
        asyncio.get_running_loop().create_task(join_later())
        return await drive(rt)

    summary = asyncio.run(main())
    check_run(rt, {**engines, "e2-dead": dead}, trainer, 8, 4, 2)
    assert not dead.log and any(op == "generate" for op, _, _ in replacement.log)
    assert summary["instances_absent_at_start"] == {"e2": "exited with status -9"}
    assert summary["failed_instances"] == ["e2"] and summary["instances_rejoined"] == 1
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_an_instance_only_late_at_the_start_is_not_counted_as_failed():
    rt, engines, trainer = make(mode="dora", n=2, steps=4, token_s=0.002)
    rt.pool.start_without({"e1": "not healthy after 5 s (still loading)"}, loading={"e1"})

    async def main():
        async def join_later():
            while not trainer.batches:
                await asyncio.sleep(0.005)
            rt.add_instance("e1", engines["e1"])
        asyncio.get_running_loop().create_task(join_later())
        return await drive(rt)

    summary = asyncio.run(main())
    check_run(rt, engines, trainer, 4, 4, 2)
    assert summary["failed_instances"] == [] and summary["instances_rejoined"] == 0
    assert "e1" in summary["instances_absent_at_start"]


class _Short:
    """Wraps a fake engine: its next ``n`` calls of ``methods`` fail as a controller out of
    descriptors fails them (aiohttp's connector error around EMFILE), before reaching the engine."""

    def __init__(self, engine, n: int, methods: tuple[str, ...]) -> None:
        self._engine, self.left, self.methods, self.raised = engine, n, methods, 0

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if name not in self.methods:
            return attr

        async def call(*args, **kwargs):
            if self.left > 0:
                import errno

                import aiohttp

                self.left -= 1
                self.raised += 1
                key = type("Key", (), {"ssl": False, "host": "127.0.0.1", "port": 1})()
                raise aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files"))
            return await attr(*args, **kwargs)
        return call


def test_the_controllers_own_shortage_fails_no_instance():
    """EMFILE on generates, stats polls, aborts and weight loads of every instance: they are tried
    again (counted as local_resource_errors), no instance is failed, every step trains exactly once.
    Before, each of these failed its instance and the run ended with 'every rollout instance failed'."""
    rt, engines, trainer = make(mode="dora", n=3, steps=4, token_s=0.002)
    short = {iid: _Short(e, 3, ("generate", "server_info", "abort", "update_weights_from_disk"))
             for iid, e in engines.items()}
    rt.engines.update(short)
    summary = asyncio.run(drive(rt))
    assert rt.pool.failed_ever == set() and summary["failed_instances"] == []
    raised = sum(s.raised for s in short.values())
    assert raised >= 3 * 3 and summary["local_resource_errors"] == raised
    check_run(rt, engines, trainer, 4, 4, 2)
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0
