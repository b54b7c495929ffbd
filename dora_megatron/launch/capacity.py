"""The two capacities no rollout mode can beat on given cores: rollout alone and training alone.

WHY: a ratio to sync says how much better a mode is than another, not how much is left. On a
fixed placement (engines on their cores, the trainer on its own) an asynchronous pipeline cannot
deliver more tokens per second than the slower of its two stages running alone, so
``min(rollout capacity, training capacity)`` is the bound each bench variant is measured against.

Both capacities count **prompt + response tokens of finished samples**, the basis of every
run's ``throughput_tokens_per_s`` (DESIGN section 9), so variant / bound is a fraction of 1:

- **rollout capacity**: the engines alone, each kept at its full admission cap
  (``min(rollout.max_running, orchestrator.cap_before_rebalance)`` requests in flight, a closed loop:
  a finished request is replaced at once) on the workload's prompts (``data.seed``, from prompt 0,
  ``group_size`` samples per prompt, the runs' sampling settings). The rate is taken over the
  steady-state window (:func:`steady_rate`): the fill and the drain are excluded.
- **training capacity**: the trainer alone (the same torchrun command as the runs, on the
  trainer's cores) on batches of ``tbs`` groups recorded by that rollout pass, in prompt order (not
  completion order, which would favour short samples). Each ``POST /train`` counts as a runtime
  step counts it (``train_s``: forward, backward, optimizer, snapshot export); the first step is
  warm-up and excluded (:func:`training_rate`). Weight pushes to engines are not part of it.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dora_megatron.comm.train_sample import TrainSample

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- pure bookkeeping
def steady_rate(completions: Sequence[tuple[float, int]], concurrency: int) -> float | None:
    """Tokens per second of a closed loop of ``concurrency`` requests, from ``(end_s, tokens)`` of
    every completion.

    The window runs from the ``concurrency``-th completion (every slot has turned over once, so the
    requests in flight are a mix of ages, not all fresh) to the last completion while the loop was
    still full (the ``N - concurrency``-th: after it a finished request is no longer replaced).
    The tokens are those of the completions inside it; at both ends requests are in flight at a
    mix of progress, so the partial work the window does not count at its end roughly matches the
    work it counts from before its start. None when there are too few completions for a window.
    """
    ordered = sorted(completions)
    lo, hi = concurrency - 1, len(ordered) - concurrency - 1  # indices of the window's two ends
    if concurrency < 1 or hi <= lo:
        return None
    span = ordered[hi][0] - ordered[lo][0]
    if span <= 0:
        return None
    return sum(tokens for _, tokens in ordered[lo + 1:hi + 1]) / span


def training_rate(steps: Sequence[tuple[int, float]], warmup: int = 1) -> float | None:
    """Tokens per second of training steps ``(tokens, seconds)``, the first ``warmup`` excluded
    (first-step costs: lazy allocations, the first snapshot directory)."""
    kept = list(steps[warmup:]) if len(steps) > warmup else []
    seconds = sum(s for _, s in kept)
    return sum(t for t, _ in kept) / seconds if kept and seconds > 0 else None


def record_batches(groups: Sequence[Sequence[TrainSample]], tbs: int, steps: int) -> list[list[TrainSample]]:
    """``steps`` training batches of ``tbs`` groups each, the groups in prompt order; fewer when
    there are not enough groups (a partial last batch is dropped: every step trains on ``tbs``)."""
    return [[s for g in groups[i * tbs:(i + 1) * tbs] for s in g] for i in range(min(steps, len(groups) // tbs))]


def bound(limits: dict[str, Any]) -> float | None:
    """The pipeline bound: min(rollout, training capacity); None when either is unknown."""
    values = [limits.get("rollout_tokens_per_s"), limits.get("training_tokens_per_s")]
    return min(values) if all(v for v in values) else None


def rollout_requests(tbs: int, group_size: int, steps: int, concurrency: int) -> int:
    """Samples the rollout pass generates: enough groups for ``steps`` training batches, and at least
    four loops' worth so that :func:`steady_rate` has a window of half of them; whole groups."""
    samples = max(steps * tbs * group_size, 4 * concurrency)
    return -(-samples // group_size) * group_size


# ---------------------------------------------------------------------- measurement
@dataclass
class _Sample:
    group: int
    index: int
    prompt: Any  # data.tasks.Prompt
    prompt_ids: list[int]
    response_ids: list[int] | None = None  # named as the training sample names them (TrainSample)
    rollout_logprobs: list[float] | None = None
    reward: float = 0.0


async def _rollout_pass(cfg, engines: dict[str, Any], codec, samples: list[_Sample], slots: int,
                        scorer) -> list[tuple[float, int]]:
    """Every sample through the engines, ``slots`` in flight per engine; ``(end_s, tokens)`` each."""
    from dora_megatron.data.reward_api import reward_input

    r = cfg.rollout
    stops = list(dict.fromkeys([*codec.eos_ids, *r.stop_token_ids]))
    queue: asyncio.Queue[_Sample] = asyncio.Queue()
    for s in samples:
        queue.put_nowait(s)
    done: list[tuple[float, int]] = []
    t0 = time.monotonic()

    async def slot(engine) -> None:
        while not queue.empty():
            s = queue.get_nowait()
            seed = zlib.crc32(f"{cfg.run.seed}/capacity/{s.group}/{s.index}".encode()) & 0x7FFFFFFF
            resp = await engine.generate(s.prompt_ids, {
                "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "stop_token_ids": stops, "sampling_seed": seed}, rid=f"capacity-{s.group}-{s.index}",
                return_logprob=True, version=0)
            s.response_ids = list(resp.output_ids)
            s.rollout_logprobs = list(resp.output_token_logprobs or [0.0] * len(s.response_ids))
            done.append((time.monotonic() - t0, len(s.prompt_ids) + len(s.response_ids)))
            s.reward = (await scorer.score(reward_input(s.prompt, codec.decode(s.response_ids)))).score

    await asyncio.gather(*(slot(e) for e in engines.values() for _ in range(slots)))
    return done


async def _measure(cfg, run_dir: Path, model_dir: Path, procs, host: str, engine_ports: list[int],
                   trainer_port: int, steps: int, say) -> dict[str, Any]:
    from dora_megatron.controller.trainer_client import TrainerClient
    from dora_megatron.data.sources import make_scorer
    from dora_megatron.data.sources import job_codec, prompt_source
    from dora_megatron.rollout.factory import engine_for
    from dora_megatron.rollout.health import wait_ready

    urls = {f"engine{i}": f"http://{host}:{p}" for i, p in enumerate(engine_ports)}
    health = cfg.vllm.health_path if cfg.rollout.engine == "vllm" else "/health"
    trainer_url = f"http://{host}:{trainer_port}"
    await asyncio.gather(
        *(wait_ready(u, path=health, timeout_s=cfg.rollout.startup_timeout_s, interval_s=0.25,
                     alive=lambda: all(c.alive() for c in procs.children)) for u in urls.values()),
        wait_ready(trainer_url, timeout_s=cfg.launch.trainer_startup_timeout_s, interval_s=0.25,
                   alive=lambda: all(c.alive() for c in procs.children)))
    engines = {n: engine_for(cfg, u, str(model_dir)) for n, u in urls.items()}
    trainer = TrainerClient(trainer_url)
    scorer = None
    try:
        codec = job_codec(cfg, model_dir)
        source = prompt_source(cfg, codec)
        scorer, _ = make_scorer(cfg.data)
        o = cfg.orchestrator
        slots = max(1, min(cfg.rollout.max_running, o.cap_before_rebalance))
        concurrency = slots * len(engines)
        n = rollout_requests(o.tbs, o.group_size, steps, concurrency)
        samples = []
        for g in range(n // o.group_size):
            prompt = source.get(g)
            ids = codec.encode_prompt(prompt)
            samples += [_Sample(g, i, prompt, list(ids)) for i in range(o.group_size)]
        say(f"bench limits: rollout alone, {len(samples)} samples, {concurrency} in flight ({slots} per engine)")
        t = time.monotonic()
        completions = await _rollout_pass(cfg, engines, codec, samples, slots, scorer)
        rollout_s = time.monotonic() - t
        groups: dict[int, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(TrainSample(s.prompt_ids, s.response_ids, s.rollout_logprobs, version=0,
                                                              reward=s.reward, group_id=f"capacity-{s.group}"))
        batches = record_batches([groups[g] for g in sorted(groups)], o.tbs, steps)
        say(f"bench limits: training alone, {len(batches)} recorded batches of {o.tbs} groups")
        train_steps = []
        for step, batch in enumerate(batches):
            t = time.monotonic()
            await trainer.train(step, batch)
            train_steps.append((sum(s.tokens() for s in batch), time.monotonic() - t))
        await trainer.shutdown()
    finally:
        if scorer is not None:
            await scorer.aclose()
        await trainer.close()
        for e in engines.values():
            await e.close()
    return {
        "rollout_tokens_per_s": steady_rate(completions, concurrency),
        "training_tokens_per_s": training_rate(train_steps),
        "rollout_samples": len(completions), "rollout_concurrency": concurrency, "rollout_wall_s": rollout_s,
        "train_steps": [{"tokens": tok, "seconds": sec} for tok, sec in train_steps],
    }


def measure_capacities(cfg, run_dir: Path, model_dir: Path, steps: int, say=log.info) -> dict[str, Any]:
    """Start the engines and the trainer of ``cfg`` (its cores and threads) and measure both
    capacities, one after the other (the idle one waits on its socket); every child is stopped on
    return or error. Returns ``rollout_tokens_per_s``, ``training_tokens_per_s`` and their inputs."""
    from dora_megatron.launch.plan import local_plan
    from dora_megatron.processes import ProcessSet
    from dora_megatron.ports import job_port_range, pick_ports

    from dora_megatron.config.loader import dump_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))  # the trainer reads its settings from the run directory
    host = cfg.rollout.host
    ports = pick_ports(cfg.rollout.num_instances + 1, host, job_port_range(cfg.launch.port_range))
    engine_ports, trainer_port = ports[:-1], ports[-1]
    plan = local_plan(cfg, str(model_dir), str(run_dir), base_port=engine_ports[0])
    with ProcessSet(run_dir / "logs", grace_s=cfg.launch.shutdown_timeout_s) as procs:
        engine_index = 0
        for spec in plan:
            if spec.role == "engine":
                argv = list(spec.argv)
                if "--port" in argv:  # free ports need not be consecutive
                    argv[argv.index("--port") + 1] = str(engine_ports[engine_index])
                engine_index += 1
                procs.start(spec.name, argv, spec.env, cpus=spec.cpus)
            elif spec.role == "trainer":
                procs.start("trainer", list(spec.argv) + ["--host", host, "--port", str(trainer_port)],
                            {**spec.env, "PYTHONUNBUFFERED": "1"}, cpus=spec.cpus)
        return asyncio.run(_measure(cfg, run_dir, model_dir, procs, host, engine_ports, trainer_port, steps, say))


def median_spread(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """Median, min and max of the known values (None when there are none)."""
    known = [v for v in values if v is not None]
    if not known:
        return None, None, None
    return statistics.median(known), min(known), max(known)
