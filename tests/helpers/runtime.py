"""Builds a :class:`~dora_megatron.controller.runtime.Runtime` on fake engines and a fake trainer,
and checks a finished run's batches; shared by the controller, observability and CLI tests."""

from __future__ import annotations

import asyncio
import json

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.controller.records import RunPaths, instance_slots
from dora_megatron.controller.runtime import Runtime
from dora_megatron.controller.trainer_client import PushOptions
from dora_megatron.data import tokenizer as tok
from dora_megatron.data.tasks import RunningSumTask, running_sum_reward
from dora_megatron.observability.recorder import MetricsRecorder, StepsJsonl, read_step_rows
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers.fakes import FakeEngine, FakeTrainer


#: the paths of a runtime on fake engines without a run directory: the fakes load any path, and
#: no checkpoint is written
NO_RUN_DIR = RunPaths(Path("/run"), Path("/model"), checkpoints=False)


def make(mode="dora", n=3, steps=6, tbs=4, rbs=8, S=2, G=2, migration=True, token_s=0.001, tmp_path=None,
         transport="disk", *, checkpoint_interval: int | None = None, rollout: RolloutConfig | None = None,
         controller: ControllerConfig | None = None, algo: AlgoConfig | None = None, push: PushOptions | None = None,
         engines: dict | None = None, trainer=None, resume_from: int | None = None,
         orchestrator: Callable[[Orchestrator], Orchestrator] | None = None, timeline=None, journal=None,
         rollout_dump=None, workflow=None, **orch):
    """A runtime on ``n`` fake engines and a fake trainer. ``tmp_path``: the run directory (its
    checkpoints, every 2 steps unless ``checkpoint_interval`` says otherwise, and ``steps.jsonl``);
    without it the run writes no checkpoint. ``rollout``, ``controller``, ``algo``, ``push``: the
    sections handed to the runtime (the config's defaults otherwise; ``transport`` sets
    ``controller.weight_transport`` of the default one).

    What the runtime's components are built with (each is handed its collaborators once, as
    ``build_controller`` does): ``engines`` (name -> client; default ``n`` fake engines named
    ``e0``...) and ``trainer`` (default a :class:`FakeTrainer` over them); ``resume_from``: the
    orchestrator is restored from that checkpoint of ``tmp_path`` (then :func:`resume` loads the
    rest); ``orchestrator(made)``: the orchestrator the runtime runs instead of ``made`` (a spy
    around it); ``timeline``, ``journal``, ``rollout_dump``, ``workflow``: as the launcher hands them."""
    orch = {"cap_before_rebalance": 6, "cap_after_rebalance": 4, **orch}
    cfg = OrchestratorConfig(mode=mode, tbs=tbs, rbs=rbs, max_staleness=S, group_size=G, rebalance_interval_s=0.05,
                             **orch)
    if engines is None:
        engines = {name: FakeEngine(name, token_s=token_s, migration=migration) for name in (f"e{i}" for i in range(n))}
    names = list(engines)
    if trainer is None:
        trainer = FakeTrainer(engines=engines)
    if checkpoint_interval is None:
        checkpoint_interval = 2 if tmp_path else 0
    run = RunConfig(steps=steps, seed=0, checkpoint_interval=checkpoint_interval)
    paths = RunPaths(tmp_path, Path("/model")) if tmp_path else NO_RUN_DIR
    task = RunningSumTask(1, 30, 1.2, seed=1)
    made = Orchestrator(cfg, names)
    if resume_from is not None:
        state = json.loads((ck_dir(tmp_path, resume_from) / "controller.json").read_text())
        made = Orchestrator.restore(cfg, state["orchestrator"])
    orchestrator_ = orchestrator(made) if orchestrator is not None else made
    rollout = rollout if rollout is not None else RolloutConfig()
    metrics = None
    if tmp_path is not None:  # a checkpointing run keeps its step record, as the launcher's does
        tmp_path.mkdir(parents=True, exist_ok=True)
        sink = StepsJsonl(open(tmp_path / "steps.jsonl", "a"))
        metrics = MetricsRecorder(slots_per_instance=instance_slots(rollout.max_running, cfg.cap_before_rebalance),
                                  rebalancer=orchestrator_.policy.rebalance,
                                  sinks=[sink])
    rt = Runtime(orchestrator_, engines, trainer, task, ThreadScorer(running_sum_reward).score_sync, run=run,
                 paths=paths, rollout=rollout,
                 controller=controller if controller is not None else ControllerConfig(weight_transport=transport),
                 observability=ObservabilityConfig(stats_interval_s=0.01), algo=algo, push=push, metrics=metrics,
                 timeline=timeline, journal=journal, rollout_dump=rollout_dump, workflow=workflow, events=EventQueue())
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
    """Load checkpoint ``version`` of a run made by :func:`make` into the fresh ``rt`` (made with
    ``resume_from=version``: its orchestrator is the checkpoint's), as ``build_controller`` does on
    ``--resume`` (runtime records, the recorder's rows from steps.jsonl), with the trainer at that
    version; returns the checkpoint's state."""
    state = json.loads((rt.checkpoints.path(version) / "controller.json").read_text())
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


def ck_dir(run_dir: Path, version: int) -> Path:
    """Checkpoint ``version`` of a run :func:`make` gave ``tmp_path=run_dir`` (the run's layout, :class:`RunPaths`)."""
    return Path(RunPaths(run_dir, Path("/model")).checkpoint_dir(version))


@dataclass(frozen=True)
class StaticWeights(RunPaths):
    """The paths of a runtime whose trainer never changes the weights (a static or fake trainer
    over real engines): every version's snapshot is the model directory; no checkpoint is written."""

    checkpoints: bool = False

    def snapshot_dir(self, version: int) -> str:
        return str(self.model_dir)
