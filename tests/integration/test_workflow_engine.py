"""A tool-using workflow on real embedded engines: the runtime runs two model turns with a
calculator result between them per trajectory, on two ``dora serve`` instances of the own model
(with a Qwen3-style tool template) that switch weight versions as steps are trained.

What only real engines show: the engine's own version guard holds every turn of a trajectory to
its version, the engine's token ids and log-probs pass the runner's token-in-token-out check, and
the rendered tool result is appended token-exactly between turns."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dora_megatron.comm.engine_client import EngineClient, VersionMismatch
from dora_megatron.config.orchestrator import OrchestratorConfig
from dora_megatron.controller.loop import EventQueue
from dora_megatron.controller.main import drive
from dora_megatron.config.controller import ControllerConfig
from dora_megatron.config.observability import ObservabilityConfig
from dora_megatron.config.rollout import RolloutConfig
from dora_megatron.config.run import RunConfig
from dora_megatron.controller.runtime import Runtime
from dora_megatron.data.codec import load_codec
from dora_megatron.data.tasks import Prompt
from dora_megatron.orchestrator import Orchestrator
from dora_megatron.workflow.api import Trajectory, WorkflowContext
from dora_megatron.workflow.runner import PinnedEngineClient, WorkflowRunner
from dora_megatron.workflow.tool_calling import env_tokens
from dora_megatron.workflow.tools import Calculator, call_tool
from dora_megatron.data.reward_api import ThreadScorer
from tests.helpers.fakes import FakeTrainer
from tests.helpers.runtime import StaticWeights

pytestmark = pytest.mark.integration

TURN = {"max_new_tokens": 5, "ignore_eos": True}
MESSAGES = ({"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 17 * 3?"})


async def calculator_turns(prompt, prompt_ids, client, ctx):
    """A model turn, the calculator's answer to 17 * 3, another model turn (whatever the random
    model writes: the environment closes its turn with the EOS)."""
    first = await client.generate(prompt_ids, TURN)
    result = await call_tool({"calculator": Calculator()}, "calculator", {"expression": "17 * 3"}, timeout_s=5)
    env = [ctx.eos_ids[0], *env_tokens(ctx.tokenizer, [{"role": "tool", "content": result.content}], ctx.eos_ids)]
    second = await client.generate(prompt_ids + first.output_ids + env, TURN)
    ids = first.output_ids + env + second.output_ids
    mask = [1] * len(first.output_ids) + [0] * len(env) + [1] * len(second.output_ids)
    return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(env) + second.logprobs, turns=2)


class Prompts:
    def get(self, index: int) -> Prompt:
        return Prompt(index, "", "51", messages=MESSAGES)


@pytest.fixture(scope="module")
def tool_dir(own_model, tmp_path_factory):
    from tests.helpers.tool_model import tool_model_dir

    return tool_model_dir(own_model.model_dir, tmp_path_factory.mktemp("tool_engine") / "model")


@pytest.fixture(scope="module")
def servers(tool_dir):
    from dora_megatron.rollout.engine.process import start_engine

    eps = []
    try:
        for _ in range(2):
            eps.append(start_engine(str(tool_dir), max_running=4, num_threads=1, weight_version="0"))
        yield eps
    finally:
        for ep in eps:
            ep.stop()


def test_tool_turns_run_on_one_version_per_trajectory_across_weight_switches(tool_dir, servers):
    codec = load_codec(tool_dir)
    cfg = OrchestratorConfig(mode="dora", tbs=2, rbs=4, max_staleness=1, group_size=2, rebalance_interval_s=0.05,
                             cap_before_rebalance=4, cap_after_rebalance=4)
    names = ["e0", "e1"]
    seen: list[str] = []

    async def main():
        engines = {n: EngineClient(ep.url, timeout_s=120) for n, ep in zip(names, servers)}
        trainer = FakeTrainer()
        sections = {"run": RunConfig(steps=3, seed=0), "paths": StaticWeights(Path("/run"), Path(tool_dir)),
                    "rollout": RolloutConfig(max_new_tokens=64, temperature=1.0),
                    "controller": ControllerConfig(verify_checksums=False, migration="reprefill"),
                    "observability": ObservabilityConfig(stats_interval_s=0.05)}
        rt = Runtime(Orchestrator(cfg, names), engines, trainer, Prompts(),
                     ThreadScorer(lambda response, answer: seen.append(response) or 0.0).score_sync, **sections, codec=codec,
                     workflow=WorkflowRunner(calculator_turns, WorkflowContext(codec.tokenizer, tuple(codec.eos_ids))),
                     events=EventQueue())
        try:
            summary = await asyncio.wait_for(drive(rt), timeout=240)
        finally:
            for e in engines.values():
                await e.close()
        return summary, trainer

    summary, trainer = asyncio.run(main())
    assert summary["lost_groups"] == 0 and summary["duplicated_groups"] == 0 and summary["c1_violations"] == 0
    samples = [s for b in trainer.batches for s in b]
    assert len(trainer.batches) == 3 and len(samples) == 3 * 2 * 2
    assert len({s.version for s in samples}) >= 2  # trajectories of several versions were trained
    tk = codec.tokenizer
    for s in samples:
        mask, ids, lps = s.loss_mask, s.response_ids, s.rollout_logprobs
        assert mask[:5] == [1] * 5 and mask[-5:] == [1] * 5 and set(mask[5:-5]) == {0}
        assert "<tool_response>\n51\n</tool_response>" in tk.decode(ids[5:-5], skip_special_tokens=False)
        assert all(lp < 0 for lp, m in zip(lps, mask) if m) and all(lp == 0 for lp, m in zip(lps, mask) if not m)
    assert all("<tool_response>" not in text for text in seen)  # the reward saw the model's turns only
    assert summary["env/trajectories"] >= 12 and summary["env/turns"] == 2 * summary["env/trajectories"]


def test_the_engine_refuses_a_turn_for_another_version(servers):
    async def main():
        async with EngineClient(servers[0].url, timeout_s=60) as engine:
            held = int((await engine.server_info())["weight_version"])
            client = PinnedEngineClient(engine, "pin-check", held + 5, {"max_new_tokens": 2, "sampling_seed": 1})
            with pytest.raises(VersionMismatch):
                await client.generate([5, 6, 7])
            assert client.engine_error is not None  # the runner hands it to the runtime as the engine's
            out = await PinnedEngineClient(engine, "pin-ok", held, {"max_new_tokens": 2, "sampling_seed": 1}
                                           ).generate([5, 6, 7])
            assert len(out.output_ids) == 2

    asyncio.run(main())


LONG = 400
LONG_TURN = {"max_new_tokens": LONG, "ignore_eos": True}  # long enough to be caught generating


def test_a_turn_moved_while_it_generates_and_a_prefix_moved_between_turns_are_never_computed_again(tool_dir, servers):
    """One trajectory of two turns on two engines: a Migrate executed while its first turn generates
    moves that turn's request with its KV (the workflow's ``generate`` answers from the other
    instance), and its next turn, placed where the orchestrator believes the last turn ran, gets the
    prefix KV carried there. Every position of the trajectory was computed once, over both engines,
    and the trajectory's ids and log-probs are whole."""
    from dora_megatron.orchestrator import Migrate

    codec = load_codec(tool_dir)
    cfg = OrchestratorConfig(mode="sync", tbs=1, rbs=1, max_staleness=0, group_size=1)
    names = ["e0", "e1"]
    runs: list[dict] = []

    async def main():
        engines = {n: EngineClient(ep.url, timeout_s=120) for n, ep in zip(names, servers)}
        for e in engines.values():  # (an earlier test of the module moved them to newer versions)
            await e.update_weights_from_disk(str(tool_dir), weight_version="0")
        before = {n: await e.server_info() for n, e in engines.items()}
        trainer = FakeTrainer()
        sections = {"run": RunConfig(steps=1, seed=0), "paths": StaticWeights(Path("/run"), Path(tool_dir)),
                    "rollout": RolloutConfig(max_new_tokens=LONG + 64, temperature=1.0),
                    "controller": ControllerConfig(verify_checksums=False, migration="kv"),
                    "observability": ObservabilityConfig(stats_interval_s=0.05)}
        async def move_once_generating(client):
            """Once the turn generates, hold the source's decoding in place (the request keeps its
            slot and KV: a loaded machine cannot let it finish before the move lands), move it."""
            src = next(n for n, e in engines.items() if e is client.engine)
            while (await client.engine.server_info())["tokens_generated"] < before[src]["tokens_generated"] + 4:
                await asyncio.sleep(0.005)
            await client.engine.pause("in_place")
            rt.execute([Migrate(client.sample_id, src, "e1" if src == "e0" else "e0", client.version)])
            return engines[src]

        async def moved_turns(prompt, prompt_ids, client, ctx):
            run = {"starts": 1, "first_engine": client.engine}
            runs.append(run)
            mover = asyncio.get_running_loop().create_task(move_once_generating(client))
            first = await client.generate(prompt_ids, LONG_TURN)
            await (await mover).continue_generation()
            run["moved_to"] = client.engine
            env = [ctx.eos_ids[0], *env_tokens(ctx.tokenizer, [{"role": "tool", "content": "51"}], ctx.eos_ids)]
            second = await client.generate(prompt_ids + first.output_ids + env, TURN)
            run["second_engine"], run["lengths"] = client.engine, (len(first.output_ids), len(second.output_ids))
            ids = first.output_ids + env + second.output_ids
            mask = [1] * len(first.output_ids) + [0] * len(env) + [1] * len(second.output_ids)
            return Trajectory(prompt_ids, ids, mask, first.logprobs + [0.0] * len(env) + second.logprobs, turns=2)

        workflow = WorkflowRunner(moved_turns, WorkflowContext(codec.tokenizer, tuple(codec.eos_ids)))
        rt = Runtime(Orchestrator(cfg, names), engines, trainer, Prompts(), ThreadScorer(lambda response, answer: 0.0).score_sync,
                     **sections, codec=codec, workflow=workflow, events=EventQueue())
        try:
            summary = await asyncio.wait_for(drive(rt), timeout=240)
            after = {n: await e.server_info() for n, e in engines.items()}
        finally:
            for e in engines.values():
                await e.close()
        return summary, trainer, before, after

    summary, trainer, before, after = asyncio.run(main())
    (run,) = runs  # the workflow ran once: the move did not start it again
    assert run["moved_to"] is not run["first_engine"] and run["second_engine"] is run["first_engine"]
    assert summary["migrations_kv"] == 1 and summary["env/trajectories_aborted"] == 0
    assert summary["workflow_turn_kv_moved"] == 1 and summary["workflow_turn_prefix_recomputed"] == 0
    (sample,) = [s for b in trainer.batches for s in b]
    ids, mask, lps = sample.response_ids, sample.loss_mask, sample.rollout_logprobs
    n1, n2 = run["lengths"]  # (a turn may end at a stop token of the job's sampling)
    assert n1 > 4 and n2 > 0 and len(ids) > n1 + n2
    assert mask[:n1] == [1] * n1 and mask[-n2:] == [1] * n2 and set(mask[n1:-n2]) == {0}
    assert all(lp < 0 for lp, m in zip(lps, mask) if m) and all(lp == 0 for lp, m in zip(lps, mask) if not m)
    computed = sum(after[n]["tokens_computed"] - before[n]["tokens_computed"] for n in names)
    assert computed == len(sample.prompt_ids) + len(ids) - 1  # each position once, the last one never fed
    assert all(a["kv_kept_blocks"] == 0 for a in after.values())  # released when the trajectory ended
