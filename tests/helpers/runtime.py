"""Builds a :class:`~dora_megatron.controller.runtime.Runtime` on fake engines and a fake trainer,
and checks a finished run's batches; shared by the controller, observability and CLI tests."""

from __future__ import annotations

import asyncio
import json

from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.controller.records import RuntimeOptions
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.observability.recorder import MetricsRecorder, StepsJsonl, read_step_rows
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers.fakes import FakeEngine, FakeTrainer


def make(mode="dora", n=3, steps=6, tbs=4, rbs=8, S=2, G=2, migration=True, token_s=0.001, tmp_path=None,
         transport="disk", **orch):
    orch = {"cap_before_rebalance": 6, "cap_after_rebalance": 4, **orch}
    cfg = OrchestratorConfig(mode=mode, tbs=tbs, rbs=rbs, max_staleness=S, group_size=G, rebalance_interval_s=0.05,
                             **orch)
    names = [f"e{i}" for i in range(n)]
    engines = {name: FakeEngine(name, token_s=token_s, migration=migration) for name in names}
    trainer = FakeTrainer(engines=engines)
    opts = RuntimeOptions(steps=steps, seed=0, weight_transport=transport, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1,
                          snapshot_dir=lambda v: f"/snap/v{v}", stats_interval_s=0.01,
                          checkpoint_interval=2 if tmp_path else 0,
                          checkpoint_dir=(lambda v: str(tmp_path / f"ck{v}")) if tmp_path else None)
    task = RunningSumTask(1, 30, 1.2, seed=1)
    orchestrator = Orchestrator(cfg, names)
    metrics = None
    if tmp_path is not None:  # a checkpointing run keeps its step record, as the launcher's does
        tmp_path.mkdir(parents=True, exist_ok=True)
        sink = StepsJsonl(open(tmp_path / "steps.jsonl", "a"))
        metrics = MetricsRecorder(slots_per_instance=opts.slots_per_instance, rebalancer=orchestrator.policy.rebalance,
                                  sinks=[sink])
    rt = Runtime(orchestrator, engines, trainer, task, ThreadScorer(running_sum_reward).score_sync, opts, metrics=metrics, events=EventQueue())
    return rt, engines, trainer


def run_killing(rt, engine, after_s: float = 0.05) -> dict:
    """Run ``rt`` to its end, making the fake ``engine`` unreachable ``after_s`` seconds in."""
    async def main():
        async def kill():
            await asyncio.sleep(after_s)
            engine.dead = True
        asyncio.get_running_loop().create_task(kill())
        return await drive(rt)

    return asyncio.run(asyncio.wait_for(main(), timeout=120))


def resume(rt, trainer, tmp_path, version: int) -> dict:
    """Load checkpoint ``ck<version>`` of a run made by :func:`make` into the fresh ``rt``, as
    ``build_controller`` does on ``--resume`` (orchestrator, runtime records, the recorder's rows
    from steps.jsonl), with the trainer at that version; returns the checkpoint's state."""
    state = json.loads((tmp_path / f"ck{version}" / "controller.json").read_text())
    rt.orch = Orchestrator.restore(rt.orch.config, state["orchestrator"])
    rt.controller_state.load_state_dict(state, read_step_rows(tmp_path / "steps.jsonl", int(state["steps_done"])))
    trainer.version = version
    return state


def check_run(rt, engines, trainer, steps, tbs, G):
    assert len(trainer.batches) == steps
    seen = set()
    for step, batch in enumerate(trainer.batches):
        groups = {s.group_id for s in batch}
        assert len(groups) == tbs and len(batch) == tbs * G
        assert not (groups & seen), "a group was trained twice"
        seen |= groups
        for s in batch:
            assert step - s.version <= rt.orch.S
            # the fake engine answers correctly: the assembled response must be exactly right
            assert s.reward == 1.0, tok.decode(s.response_ids)
            assert len(s.rollout_logprobs) == len(s.response_ids)
    # C1 from what the engines saw: every request of a sample (generate, import) ran on one version
    versions = engine_versions(engines)
    assert all(len(vs) == 1 for vs in versions.values()), {rid: vs for rid, vs in versions.items() if len(vs) > 1}
    # the runtime forgot every consumed group's records (the orchestrator owns run state)
    assert not any(rec.group_id in seen for rec in rt.store.samples.values()) and not set(rt.store.groups) & seen


def engine_versions(engines) -> dict[str, set[int]]:
    """Sample id -> the weight versions the engines ran its requests on (their own logs)."""
    out: dict[str, set[int]] = {}
    for e in engines.values():
        for op, rid, version in e.log:
            if op in ("generate", "import"):
                out.setdefault(rid, set()).add(version)
    return out


def trained_groups(trainer) -> set[str]:
    return {s.group_id for batch in trainer.batches for s in batch}
