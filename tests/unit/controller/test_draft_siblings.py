"""rollout.speculative=group: the runtime hands each request its group's finished siblings, at
submission (``draft_sources``) and when a sibling finishes later (``add_draft_sources``); the
instances' speculation counters reach the summary."""

from __future__ import annotations

import asyncio

from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.controller.main import drive

from tests.helpers.fakes import FakeEngine
from tests.helpers.runtime import check_run, make


class DraftEngine(FakeEngine):
    """FakeEngine that offers draft_sources and records what it is given; sample ``.1`` of each
    group decodes 5x slower, so its sibling finishes first."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.submitted: dict[str, tuple[list[int], list[list[int]]]] = {}
        self.pushed: list[tuple[str, list[list[int]]]] = []
        self.running_at_push: list[int] = []  # requests this engine held when each push came

    async def supports(self, name: str) -> bool:
        return name == "draft_sources" or await super().supports(name)

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, version=None,
                       draft_sources=()):
        self.submitted[rid] = (list(input_ids), [list(s) for s in draft_sources])
        return await super().generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                      version=version)

    async def add_draft_sources(self, rid, sources):
        self.pushed.append((rid, [list(s) for s in sources]))
        self.running_at_push.append(len(self.reqs))
        return rid in self.reqs

    async def server_info(self):
        info = await super().server_info()
        return {**info, "spec_verify_steps": 10, "spec_draft_tokens": 40, "spec_accepted_tokens": 15,
                "spec_verify_tokens": 25}

    def _token_time(self, req) -> float:
        return self.token_s * (5 if req.rid.endswith(".1") else 1)


def _run(draft_siblings: bool, push_max_batch: int = 0):
    rollout = RolloutConfig(speculative="group" if draft_siblings else "off", spec_max_batch=push_max_batch)
    rt, engines, trainer = make(mode="dora", n=3, steps=3, rollout=rollout)
    fakes = {name: DraftEngine(name, token_s=0.001) for name in engines}
    rt.engines.clear()
    rt.engines.update(fakes)
    summary = asyncio.run(drive(rt))
    return rt, fakes, trainer, summary


def test_running_siblings_get_the_finished_ones_output():
    rt, engines, trainer, summary = _run(True)
    check_run(rt, engines, trainer, 3, 4, 2)
    spec = summary["speculation"]  # every instance's counters, summed over the run
    assert spec["spec_verify_steps"] == 30 and spec["tokens_per_verify_step"] == 2.5
    pushed = [p for e in engines.values() for p in e.pushed]
    assert pushed, "no finished sibling was pushed to a running one"
    submitted = {rid: ids for e in engines.values() for rid, (ids, _) in e.submitted.items()}
    for rid, sources in pushed:
        assert rid.endswith(".1")  # the slow sibling receives; the fast one finished first
        prompt = submitted[rid]
        assert len(sources) == 1 and sources[0][: len(prompt)] == prompt  # same prompt: same group
        assert sources[0] == prompt + FakeEngine._answer(prompt)  # the sibling's whole output


def test_pushes_reach_only_instances_small_enough_to_speculate():
    """With the bound at 1 (``rollout.spec_max_batch``) the runtime holds each push until its
    instance runs one request: the slow sibling still gets its finished sibling, later."""
    rt, engines, trainer, _ = _run(True, push_max_batch=1)
    check_run(rt, engines, trainer, 3, 4, 2)
    unbounded = _run(True)[1]
    assert sum(len(e.pushed) for e in engines.values()) > 0
    assert max(n for e in engines.values() for n in e.running_at_push) <= 1
    assert max(n for e in unbounded.values() for n in e.running_at_push) > 1  # without the bound they do not wait


def test_off_nothing_is_sent():
    _, engines, _, _ = _run(False)
    assert not any(e.pushed for e in engines.values())
    assert not any(src for e in engines.values() for _, src in e.submitted.values())


def test_the_summary_keeps_what_an_instance_reported_before_it_was_restarted():
    """Reports 10 then 25 verify steps, then (restarted, counting from 0) 4: 29 in all, not 4."""
    rt, engines, _ = make(mode="dora", n=2, steps=1)
    iid = next(iter(rt.engines))
    for steps in (10, 25, 4):
        rt.stats.apply_load(iid, rt.engines[iid], {"num_running_reqs": 1, "kv_usage": 0.1, "spec_verify_steps": steps,
                                              "spec_verify_tokens": 2 * steps})
    spec = rt.summary(1.0)["speculation"]
    assert spec["spec_verify_steps"] == 29 and spec["spec_verify_tokens"] == 58


class GatedEngine:
    """An engine whose draft pushes wait for ``gate`` (a push waits for the engine's step); it
    records each call and the most calls it held at once."""

    def __init__(self, fails: bool = False) -> None:
        self.gate = asyncio.Event()
        self.calls: list[tuple[str, list[list[int]]]] = []
        self.inflight = self.most = 0
        self.fails = fails

    async def add_draft_sources(self, rid, sources):
        self.calls.append((rid, [list(s) for s in sources]))
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await self.gate.wait()
            if self.fails:
                raise ConnectionResetError("gone")
            return True
        finally:
            self.inflight -= 1


def test_pushes_go_one_at_a_time_per_instance_and_merge_what_waits_for_one_request():
    from dora_megatron.controller.siblings import MAX_PENDING_SOURCES, DraftPushes

    async def main():
        engines = {"e0": GatedEngine(), "e1": GatedEngine(), "e2": GatedEngine(fails=True)}
        loop = asyncio.get_running_loop()
        tasks = []
        drafts = DraftPushes(engines, lambda coro, name: tasks.append(loop.create_task(coro)))
        drafts.offer([("e0", "a"), ("e0", "b"), ("e1", "c"), ("e2", "d")], [1])
        await asyncio.sleep(0.01)  # e0's first push (a) is on the wire; b waits
        for src in ([2], [3]):
            drafts.offer([("e0", "a"), ("e0", "b")], src)
        for n in range(MAX_PENDING_SOURCES + 2):
            drafts.offer([("e0", "z")], [100 + n])
        await asyncio.sleep(0.01)
        assert engines["e0"].calls == [("a", [[1]])] and engines["e1"].calls == [("c", [[1]])]
        for e in engines.values():
            e.gate.set()
        await asyncio.gather(*tasks)
        return engines, drafts

    engines, drafts = asyncio.run(main())
    assert engines["e0"].calls == [("a", [[1]]), ("b", [[1], [2], [3]]), ("a", [[2], [3]]),
                                   ("z", [[100 + n] for n in range(2, MAX_PENDING_SOURCES + 2)])]
    assert max(e.most for e in engines.values()) == 1  # never two pushes on one instance's connections
    assert drafts.calls == 6 and drafts.taken == 1 + 3 + 2 + MAX_PENDING_SOURCES + 1  # e2's failure lost one
    assert not drafts.pending and not drafts.sending  # every task ended, nothing left behind


def test_group_speculation_gives_the_pushes_a_connection_of_their_own():
    from dora_megatron.comm.limits import CONTROL_CONNECTIONS
    from dora_megatron.config.schema import load_config
    from dora_megatron.controller.clients import connection_plan

    off = connection_plan(load_config(None, []), 2)
    group = connection_plan(load_config(None, ["rollout.speculative=group"]), 2)
    assert off.control == CONTROL_CONNECTIONS and group.control == CONTROL_CONNECTIONS + 1
    assert group.generate == off.generate  # the generates keep every slot's connection


def test_pushes_wait_while_their_instance_is_too_busy_to_speculate_and_a_finished_request_drops_them():
    """An instance running more requests than the bound does not speculate, so its pushes wait,
    merged, until a sweep finds it small enough; what waits for a request that finished is dropped."""
    from dora_megatron.controller.siblings import DraftPushes

    async def main():
        engines = {"e0": GatedEngine(), "e1": GatedEngine()}
        for e in engines.values():
            e.gate.set()
        load = {"e0": 12, "e1": 2}
        loop = asyncio.get_running_loop()
        tasks = []
        drafts = DraftPushes(engines, lambda coro, name: tasks.append(loop.create_task(coro)),
                             may_push=lambda instance: load[instance] <= 8)
        drafts.offer([("e0", "a"), ("e0", "b"), ("e1", "c")], [1])
        drafts.offer([("e0", "a"), ("e0", "b")], [2])
        await asyncio.gather(*tasks)
        held = [list(e.calls) for e in engines.values()]
        drafts.forget("e0", "b")  # b finished while it waited
        drafts.release_ready()  # a sweep: e0 still busy
        await asyncio.gather(*tasks)
        still = list(engines["e0"].calls)
        load["e0"] = 8
        drafts.release_ready()
        await asyncio.gather(*tasks)
        return held, still, engines, drafts

    held, still, engines, drafts = asyncio.run(main())
    assert held == [[], [("c", [[1]])]] and still == []  # e1 is small: sent at once; e0 waits
    assert engines["e0"].calls == [("a", [[1], [2]])]  # one call with both sources, none for b
    assert not drafts.pending and not drafts.sending


def _one_instance_bounded_at_8(load: dict[str, int]):
    """(engines, DraftPushes, its tasks) for one open instance ``e0`` whose pushes wait while
    ``load["e0"]`` is above 8; call inside the running event loop."""
    from dora_megatron.controller.siblings import DraftPushes

    engines = {"e0": GatedEngine()}
    engines["e0"].gate.set()
    loop = asyncio.get_running_loop()
    tasks: list = []
    drafts = DraftPushes(engines, lambda coro, name: tasks.append(loop.create_task(coro)),
                         may_push=lambda instance: load[instance] <= 8)
    return engines, drafts, tasks


def test_a_finish_that_brings_the_instance_to_the_bound_releases_its_held_pushes_without_a_sweep():
    """The orchestrator counts a finish after the runtime's bookkeeping in the same loop turn, so the
    push check a finish triggers runs once the turn is over and sees the load the finish left: the
    tail's held pushes go out then, not at the next stats sweep. A finish that leaves the instance
    above the bound sends nothing."""
    async def main():
        load = {"e0": 10}
        engines, drafts, tasks = _one_instance_bounded_at_8(load)
        drafts.offer([("e0", "a")], [1])  # held: e0 runs 10
        drafts.finished("e0", "x")  # a finish in a turn ...
        load["e0"] = 9  # ... that the orchestrator counts after it: still above the bound
        await asyncio.gather(*tasks)
        above = list(engines["e0"].calls)
        drafts.finished("e0", "y")
        load["e0"] = 8  # this one brings e0 to the bound
        await asyncio.gather(*tasks)
        return above, engines, drafts

    above, engines, drafts = asyncio.run(main())
    assert above == []
    assert engines["e0"].calls == [("a", [[1]])]  # no release_ready() was called
    assert not drafts.pending and not drafts.sending


def test_the_push_a_finish_offers_goes_out_when_that_finish_brings_the_instance_to_the_bound():
    """The tail's usual case, in the runtime's order: nothing is held, a sibling finishes on a busy
    instance and its answer is offered to the one still running there (held: the orchestrator has
    not counted the finish yet), then the finish is counted and the instance is at the bound. The
    push goes out after the turn, without a stats sweep."""
    async def main():
        load = {"e0": 9}
        engines, drafts, tasks = _one_instance_bounded_at_8(load)
        drafts.offer([("e0", "b")], [1, 2])  # a's answer, for b (what Generation.absorb does first)
        drafts.finished("e0", "a")
        load["e0"] = 8  # the orchestrator counts a's finish in the same turn
        await asyncio.gather(*tasks)
        return engines, drafts

    engines, drafts = asyncio.run(main())
    assert engines["e0"].calls == [("b", [[1, 2]])]
    assert not drafts.pending and not drafts.sending
