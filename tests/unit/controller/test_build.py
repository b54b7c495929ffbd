"""``build_controller``: the controller of a run from the typed config and the endpoints a
launcher started, fresh or resumed from a checkpoint (orchestrator, runtime state and journal)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config
from dora_megatron.controller.main import Endpoints, build_controller, drive
from dora_megatron.data.tokenizer import save_tokenizer

from tests.helpers.runtime import ck_dir, make

ROOT = Path(__file__).resolve().parents[3]
# the orchestrator of test_runtime.make(): a checkpoint it wrote restores under this config
ORCH = ["orchestrator.mode=dora", "orchestrator.tbs=4", "orchestrator.rbs=8", "orchestrator.max_staleness=2",
        "orchestrator.group_size=2", "orchestrator.cap_before_rebalance=6", "orchestrator.cap_after_rebalance=4"]


def _dirs(tmp_path):
    run_dir, model_dir = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir()
    model_dir.mkdir()
    save_tokenizer(model_dir)
    return run_dir, model_dir


def test_a_fresh_controller_reads_each_setting_from_its_config_section(tmp_path):
    run_dir, model_dir = _dirs(tmp_path)
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml",
                      ["rollout.max_new_tokens=17", "controller.migration=reprefill", "run.steps=5",
                       "controller.health_timeout_s=7", "rollout.stop_token_ids=[3]", "observability.warmup_steps=2"])
    urls = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}
    checkpoints = []
    ctl = build_controller(cfg, Endpoints(urls, "http://127.0.0.1:3"), run_dir=run_dir, model_dir=model_dir,
                           make_engine=lambda url: f"client:{url}", on_checkpoint=checkpoints.append)
    rt = ctl.runtime
    assert rt.engines == {"a": "client:http://127.0.0.1:1", "b": "client:http://127.0.0.1:2"}
    assert sorted(ctl.orch.instances) == ["a", "b"] and ctl.orch.config == cfg.orchestrator
    assert ctl.trainer.base_url == "http://127.0.0.1:3"
    assert (rt.training.run.steps, rt.store.rollout.max_new_tokens, rt.moves.controller.migration) == (5, 17, "reprefill")
    assert rt.stats.controller.health_timeout_s == 7 and rt.store.rollout.stop_token_ids == [3]
    assert rt.metrics.warmup_steps == 2  # summary.json's rate metrics leave out the first 2 steps
    assert rt.weights.paths.snapshot_dir(0) == str(model_dir)
    assert Path(rt.weights.paths.snapshot_dir(3)).parent == run_dir / "weights"
    assert Path(rt.checkpoints.path(2)).parent == run_dir / "checkpoints"
    rt.controller_state.on_checkpoint(4)  # handed in, not patched onto the runtime from outside
    assert checkpoints == [4] and ctl.state is None


def test_a_resumed_controller_continues_from_the_checkpoint(tmp_path):
    run_dir, model_dir = _dirs(tmp_path)
    rt0, _, _ = make(mode="dora", steps=4, tmp_path=tmp_path)
    asyncio.run(drive(rt0))
    checkpoint = run_dir / "checkpoints" / "v000002"
    shutil.copytree(ck_dir(tmp_path, 2), checkpoint)
    state = json.loads((checkpoint / "controller.json").read_text())
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml", [*ORCH, "run.steps=6", "run.checkpoint_interval=2"])
    ctl = build_controller(cfg, Endpoints({"e0": "u0", "e1": "u1", "e2": "u2"}, "http://127.0.0.1:3"),
                           run_dir=run_dir, model_dir=model_dir, make_engine=lambda url: url, checkpoint=checkpoint)
    rt = ctl.runtime
    assert ctl.state == state and ctl.orch.snapshot() == state["orchestrator"]
    assert rt.training.steps_done == 2 and rt.weights.latest_version == 2
    assert rt.store.next_prompt == state["next_prompt"]
    # consumed groups stay out of controller.json (consumed.jsonl lists them): it grows with outstanding work
    assert "consumed" not in state and set(rt.store.groups) == {g["group_id"] for g in state["groups"]}
    assert {g["group_id"] for g in state["groups"]}.isdisjoint(g for r in rt.metrics.rows for g in r.groups)
    assert ctl.journal is not None  # cpu_tiny journals; a resume starts a new lineage at v2
    ctl.close()
    assert json.loads((run_dir / "journal.jsonl").read_text().splitlines()[0]) == {"t": "checkpoint", "version": 2}


def test_warmup_steps_must_leave_a_step_to_measure():
    with pytest.raises(ConfigError, match=r"observability.warmup_steps.*3 must be < run.steps \(3\)"):
        load_config(ROOT / "configs" / "cpu_tiny.yaml", ["run.steps=3", "observability.warmup_steps=3"])


def test_rollout_workflow_and_its_options_reach_the_runtime(tmp_path):
    run_dir, model_dir = _dirs(tmp_path)
    urls = {"a": "http://127.0.0.1:1"}
    plain = build_controller(load_config(ROOT / "configs" / "cpu_tiny.yaml"), Endpoints(urls, "http://127.0.0.1:3"),
                             run_dir=run_dir, model_dir=model_dir, make_engine=str)
    assert plain.runtime.workflow is None  # the default single turn: one /generate per submission
    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml",
                      ["rollout.workflow=tests.helpers.workflows:two_turns",
                       "rollout.workflow_kwargs={max_turns: 2}"])
    shutil.rmtree(run_dir)
    run_dir.mkdir()
    rt = build_controller(cfg, Endpoints(urls, "http://127.0.0.1:3"), run_dir=run_dir, model_dir=model_dir,
                          make_engine=str).runtime
    from tests.helpers.workflows import two_turns

    assert rt.workflow.workflow is two_turns and dict(rt.workflow.ctx.options) == {"max_turns": 2}
    assert rt.workflow.ctx.tokenizer is None and rt.workflow.ctx.eos_ids == (2,)  # the preset char vocabulary


@pytest.mark.parametrize("sets, key", [
    (["rollout.workflow=agent"], "rollout.workflow"),
    (["rollout.workflow_kwargs={max_turns: 2}"], "rollout.workflow_kwargs"),
    (["rollout.workflow=tool_calling", "rollout.speculative=group"], "rollout.speculative"),
    (["rollout.workflow=tool_calling", "algo.routing_replay=true"], "algo.routing_replay"),
])
def test_a_workflow_setting_that_cannot_act_is_refused_naming_the_key(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(ROOT / "configs" / "cpu_tiny.yaml", sets)
