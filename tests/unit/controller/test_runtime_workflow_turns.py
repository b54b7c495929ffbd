"""A workflow's trajectory between its turns, on fake engines: while its tool runs it holds no slot
(another sample runs a turn in it), its next turn may run on another instance of its version
(counted), and an engine killed between turns or inside one loses and duplicates nothing."""

from __future__ import annotations

import asyncio

from dora_megatron.controller.main import drive
from dora_megatron.workflow.api import Trajectory
from dora_megatron.comm.engine_client import EngineError
from tests.helpers.fakes import FakeEngine
from tests.helpers.runtime import check_run, engine_versions, make
from tests.helpers.runtime_workflow import ENV, answer_then_env, check_trajectories, make_with_workflow

WAIT_S = 2.0  # bound of a tool's wait for another sample's turn (reached only when no slot is free)


class ToolThatWaitsForAnotherTurn:
    """A two-turn workflow whose tool (between the turns) lasts until another sample's turn returned
    (at most :data:`WAIT_S`): with the instance's one slot held through the tool, none can, and the
    tool runs out its bound instead. ``hook(client)`` runs as the tool starts (a test's fault)."""

    def __init__(self, hook=None) -> None:
        self.rt = None  # the runtime it runs in (set once made): the tool reads its orchestrator's view
        self.hook = hook
        self.waiting: dict[str, asyncio.Event] = {}
        self.overlapped: list[bool] = []  # per tool call: another sample's turn returned during it
        self.states: list[str] = []  # the orchestrator's state of the sample during its tool call
        self.turn_engines: dict[str, list[str]] = {}  # sample id -> the engines of its turns (finished ones)

    def _turn_returned(self, sample_id: str) -> None:
        for sid, ev in self.waiting.items():
            if sid != sample_id:
                ev.set()

    async def __call__(self, prompt, prompt_ids, client, ctx):
        sid = client.sample_id
        first = await client.generate(prompt_ids)
        engines = [client.engine.name]
        self._turn_returned(sid)
        self.states.append(self.rt.orch.sample_status(sid)["state"])
        if self.hook is not None:
            self.hook(client)
        self.waiting[sid] = ev = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), WAIT_S)
            self.overlapped.append(True)
        except TimeoutError:
            self.overlapped.append(False)
        finally:
            del self.waiting[sid]
        second = await client.generate(prompt_ids + first.output_ids + ENV)
        engines.append(client.engine.name)
        self._turn_returned(sid)
        self.turn_engines[sid] = engines
        ids = first.output_ids + ENV + second.output_ids
        mask = [1] * len(first.output_ids) + [0] * len(ENV) + [1] * len(second.output_ids)
        return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(ENV) + second.logprobs, turns=2)


class StartsCounted:
    """The two-turn workflow, counting the runs of each sample's workflow (a move during a turn
    must not start one again)."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}

    async def __call__(self, prompt, prompt_ids, client, ctx):
        self.starts[client.sample_id] = self.starts.get(client.sample_id, 0) + 1
        return await answer_then_env(prompt, prompt_ids, client, ctx)


def _one_slot_each(n, steps, G=1, tbs=1, rbs=2, **kw):
    return make(mode="dora", n=n, steps=steps, tbs=tbs, rbs=rbs, S=1, G=G, token_s=0.001,
                cap_before_rebalance=1, cap_after_rebalance=1, **kw)


def test_the_slot_is_free_while_the_tool_runs_and_another_sample_runs_a_turn_in_it():
    wf = ToolThatWaitsForAnotherTurn()
    rt, engines, trainer, seen = make_with_workflow(wf, _one_slot_each, n=1, steps=3)
    wf.rt = rt
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 3, 1, 1)
    check_trajectories(trainer, seen)
    assert wf.states and set(wf.states) == {"waiting"}  # off the instance while its tool ran
    assert any(wf.overlapped)  # the one slot ran another sample's turn during a tool call
    log = [rid for op, rid, _ in engines["e0"].log if op == "generate"]
    interleaved = [rid for rid in set(log) if log.index(rid) + 1 < len(log) and log[log.index(rid) + 1] != rid]
    assert interleaved  # the engine saw another sample between a trajectory's two turns
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_a_trajectory_continues_on_another_instance_of_its_version_between_turns():
    wf = ToolThatWaitsForAnotherTurn()
    rt, engines, trainer, seen = make_with_workflow(wf, _one_slot_each, n=4, steps=4, G=2, tbs=2, rbs=8)
    wf.rt = rt
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 4, 2, 2)  # C1 from the engines' logs: both turns on one version
    check_trajectories(trainer, seen)
    moved = {sid for sid, names in wf.turn_engines.items() if len(set(names)) > 1}
    assert moved and summary["workflow_turn_moves"] >= 1
    versions = engine_versions(engines)
    assert all(len(versions[sid]) == 1 for sid in moved)
    calls = [rid for e in engines.values() for op, rid, _ in e.log if op == "generate"]
    assert any(calls.count(sid) == 2 for sid in moved)  # moved between turns without running again
    # these engines keep no KV between turns: every move computed its prefix again
    assert summary["workflow_turn_prefix_recomputed"] >= 1 and summary["workflow_turn_kv_moved"] == 0
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_a_trajectory_moved_between_turns_takes_its_prefix_kv_along_and_frees_it_when_it_ends():
    """Engines that keep a turn's KV (``keep_kv``): a next turn on the same instance continues the
    kept KV; one placed on another instance gets it carried there (export_kv, import_kv) first.
    Whatever ended a trajectory, no KV of it stays kept on a live engine."""
    wf = ToolThatWaitsForAnotherTurn()
    rt, engines, trainer, seen = make_with_workflow(wf, _one_slot_each, n=4, steps=4, G=2, tbs=2, rbs=8)
    wf.rt = rt
    for name in list(engines):
        engines[name] = rt.engines[name] = FakeEngine(name, token_s=0.001, keep_kv=True)
    trainer.engines = {e.base_url: e for e in engines.values()}
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 4, 2, 2)
    check_trajectories(trainer, seen)
    moved = {sid for sid, names in wf.turn_engines.items() if len(set(names)) > 1}
    assert moved and summary["workflow_turn_kv_moved"] >= 1
    log = {name: [(op, rid) for op, rid, _ in e.log] for name, e in engines.items()}
    carried = [sid for sid in moved if ("import_kv", sid) in log[wf.turn_engines[sid][1]]]
    assert len(carried) == summary["workflow_turn_kv_moved"]
    for sid in carried:  # its second turn continued the KV carried to its instance
        assert ("reuse", sid) in log[wf.turn_engines[sid][1]] and ("export_kv", sid) in log[wf.turn_engines[sid][0]]
    stayed = {sid for sid, names in wf.turn_engines.items() if len(set(names)) == 1}
    assert any(("reuse", sid) in log[wf.turn_engines[sid][0]] for sid in stayed)
    assert summary["workflow_turn_kv_moved"] + summary["workflow_turn_prefix_recomputed"] >= len(moved)
    trained = {s.group_id for b in trainer.batches for s in b}
    held = {rid for e in engines.values() for rid in e.kept}
    assert held.isdisjoint(sid for sid in wf.turn_engines if sid.rsplit(".", 1)[0] in trained)
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_an_engine_killed_between_turns_or_inside_one_loses_and_duplicates_nothing():
    """e1 dies while a trajectory that ran its first turn there is in its tool (between turns): the
    trajectory's next turn runs elsewhere, it is not run again; then another instance dies with
    turns in flight (inside a turn): those trajectories run again from their prompts on their version."""
    killed: dict[str, object] = {}

    def kill(client):
        name = client.engine.name
        if name == "e1" and "between" not in killed:
            killed["between"] = client.sample_id
            engines["e1"].dead = True
        elif "between" in killed and "inside" not in killed:
            busy = [e for e in engines.values() if not e.dead and e.reqs and e.name != name]
            if busy:
                killed["inside"], killed["inside_at"] = set(busy[0].reqs), busy[0].name
                busy[0].dead = True

    wf = ToolThatWaitsForAnotherTurn(kill)
    rt, engines, trainer, seen = make_with_workflow(wf, _one_slot_each, n=3, steps=4, G=2, tbs=1, rbs=4)
    wf.rt = rt
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 4, 1, 2)
    check_trajectories(trainer, seen)
    assert killed.get("inside") and {"e1", killed["inside_at"]} <= set(summary["failed_instances"])
    between = killed["between"]
    first_turns = [name for name, e in engines.items() for op, rid, _ in e.log if op == "generate" and rid == between]
    assert wf.turn_engines[between][0] == "e1" and wf.turn_engines[between][1] != "e1"
    assert len(first_turns) == 2  # one turn on e1 before the kill, the next elsewhere: not run again
    for sid in killed["inside"]:  # in flight there when it died: run again whole elsewhere
        assert killed["inside_at"] not in wf.turn_engines[sid]
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_partial_mode_runs_a_trajectory_again_on_the_newer_weights_its_next_turn_is_placed_on():
    """In partial mode a turn waiting for a slot is placed on the newest weights; a trajectory whose
    tool outlived a weight update therefore runs again from its prompt on them, never mixing versions."""
    outlived: list[str] = []

    async def tool_outlives_an_update(prompt, prompt_ids, client, ctx):
        first = await client.generate(prompt_ids)
        for _ in range(20):  # the tool lasts until the trainer produced newer weights (bounded)
            if rt.orch.newest > client.version:
                outlived.append(client.sample_id)
                break
            await asyncio.sleep(0.01)
        second = await client.generate(prompt_ids + first.output_ids + ENV)
        ids = first.output_ids + ENV + second.output_ids
        mask = [1] * len(first.output_ids) + [0] * len(ENV) + [1] * len(second.output_ids)
        return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(ENV) + second.logprobs, turns=2)

    rt, engines, trainer, seen = make_with_workflow(tool_outlives_an_update, mode="partial", n=2, steps=4,
                                                    token_s=0.001)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_trajectories(trainer, seen)
    assert outlived and summary["env/trajectories_aborted"] > 0
    calls = [(rid, v) for e in engines.values() for op, rid, v in e.log if op == "generate"]
    trained = [s for b in trainer.batches for s in b]
    assert len({s.group_id for s in trained}) == 4 * 4 and all(s.reward == 1.0 for s in trained)
    again = {rid for rid, v in calls if rid in outlived and any(r == rid and w > v for r, w in calls)}
    assert again  # an outlived trajectory ran again on the newer version
    assert summary["c1_violations"] == 0 and summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0


def test_a_move_ordered_during_a_turn_moves_that_turn_with_its_kv_and_the_workflow_goes_on():
    """The rebalances of a DORA run move requests between instances of a version; a trajectory's
    turn caught generating moves with its KV (export, import) and its ``generate`` answers from the
    destination: the workflow is never started again, the turn is not recomputed."""
    wf = StartsCounted()
    rt, engines, trainer, seen = make_with_workflow(wf, mode="dora", n=4, steps=8, token_s=0.002)
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_run(rt, engines, trainer, 8, 4, 2)
    check_trajectories(trainer, seen)
    log = [(op, rid) for e in engines.values() for op, rid, _ in e.log]
    moved = {rid for op, rid in log if op == "import"}
    assert moved and summary["migrations_kv"] == len([1 for op, _ in log if op == "import"])
    trained = {s.group_id for b in trainer.batches for s in b}
    for sid in moved:
        assert wf.starts[sid] == 1  # the workflow went on: not run again
        if sid.rsplit(".", 1)[0] in trained:  # two turns, one generate each: the moved one was not submitted again
            assert [op for op, rid in log if rid == sid].count("generate") == 2
    assert summary["migrations_reprefill"] == 0 and summary["reprefill_tokens"] == 0
    assert summary["env/trajectories_aborted"] == 0
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0


def test_a_source_that_dies_after_letting_a_moved_turn_go_is_the_only_instance_failed():
    """The first instance a turn is exported from dies right after the export, before its own answer
    (``migrated``) comes back: the turn goes on at its destination, which is not blamed."""
    wf = StartsCounted()
    rt, engines, trainer, seen = make_with_workflow(wf, mode="dora", n=4, steps=8, token_s=0.002)
    died: list[tuple[str, str]] = []

    class DiesAfterItsFirstExport(FakeEngine):
        async def export_request(self, rid):
            blob = await super().export_request(rid)
            if not died:
                died.append((self.name, rid))
                self.dead = True
            return blob

        async def _run(self, req):
            resp = await super()._run(req)
            if self.dead:  # its answer never comes: the connection fails
                raise EngineError(self.name, 503, "dead")
            return resp

    for name in list(engines):
        engines[name] = rt.engines[name] = DiesAfterItsFirstExport(name, token_s=0.002)
    trainer.engines = {e.base_url: e for e in engines.values()}
    summary = asyncio.run(asyncio.wait_for(drive(rt), timeout=120))
    check_trajectories(trainer, seen)
    (src, sid), = died
    assert summary["failed_instances"] == [src]  # not the destination of the turn it let go
    assert wf.starts[sid] == 1  # that turn went on where it was moved
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
