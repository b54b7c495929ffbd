"""What a migration by abort + resubmit costs on real SGLang servers: re-prefill against decode.

    nice -n 10 python tools/bench_reprefill.py --reps 5 --lengths 16 64 256 1024 --out /tmp/reprefill.json

SGLang has no KV migration, so dora moves an in-flight request between two instances of one version
by aborting it at its source and resubmitting prompt + partial output at the destination, which
prefills those tokens again (counted as ``reprefill_tokens``). This tool measures what that costs,
against two real SGLang CPU servers it starts (the flags and environment dora's launcher computes
from ``--config``, ``configs/cpu_sglang.yaml`` by default: one OMP thread, ``--sleep-on-idle``) on
the tiny Qwen3-MoE of the ``tiny-moe`` preset (random weights: the timing does not depend on them),
and stops by pid (its process group: SIGTERM, SIGKILL 2 s later) however it ends.

For each repetition and each partial-output length ``L``, side by side, with dora's own SGLang
client (:class:`~dora_megatron.rollout.sglang.engine.SGLangEngine`, as the runtime drives SGLang):

1. a fresh random prompt ``P`` (``--prompt-tokens``) is prefilled on the *origin* (a 1-token
   ``/generate``), then timed twice there: 1 new token (``base``) and ``L + 1`` new tokens with
   ``ignore_eos`` (``full``); ``decode_s = full - base``: the origin decoding ``L`` tokens;
2. the resubmission ``P + partial`` (the ``L`` tokens the origin produced), 1 new token, on the
   *destination*, which never saw them: ``reprefill_s``, the re-prefill's time to first new token;
3. the same resubmission on the origin, whose radix cache holds ``P + partial``: ``warm_s``.

Each server answers ``meta_info.cached_tokens``; the tool checks that the destination's prefill
hit no cache and the origin's warm one did, so the three timings are what they say. Prints a
markdown table (medians and ranges over repetitions of within-repetition values), and with
``--moves/--tokens/--run-s`` an estimate of a run's re-prefill time from its counters
(:func:`~dora_megatron.launch.reprefill_cost.run_estimate`). ``--out`` keeps every timing as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_megatron.launch.reprefill_cost import RepTiming, Spread, fit_line, length_row, run_estimate  # noqa: E402

if TYPE_CHECKING:
    from dora_megatron.comm.protocol import GenerateResponse
    from dora_megatron.config.schema import DoraConfig
    from dora_megatron.processes import ProcessSet
    from dora_megatron.rollout.sglang.engine import SGLangEngine

log = logging.getLogger("bench_reprefill")
ROOT = Path(__file__).resolve().parents[1]
#: no py-spy/CUDA dump "before crash" when a server is stopped (0.5.23 sleeps 5 s for them)
QUICK_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "cpu_sglang.yaml"),
                   help="dora config whose rollout:/sglang: sections give the servers' flags")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as dora train --set (repeatable)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024],
                   help="partial-output lengths, tokens")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length, tokens")
    p.add_argument("--reps", type=int, default=5, help="repetitions (after one warm-up round)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the model's weights")
    p.add_argument("--moves", type=int, help="a run's resubmissions (summary migrations_reprefill)")
    p.add_argument("--tokens", type=int, help="a run's re-prefilled tokens (summary reprefill_tokens)")
    p.add_argument("--run-s", type=float, help="that run's wall time, seconds")
    p.add_argument("--out", help="write every timing and the summary here as JSON")
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.prompt_tokens < 1 or args.reps < 1:
        p.error(f"--lengths {args.lengths}, --prompt-tokens {args.prompt_tokens} and --reps {args.reps} must be >= 1")
    if len(set(args.lengths)) < 2:
        p.error(f"--lengths needs at least two distinct lengths (a per-token fit), got {args.lengths}")
    given = [x is not None for x in (args.moves, args.tokens, args.run_s)]
    if any(given) and not all(given):
        p.error("--moves, --tokens and --run-s go together (a run's counters and wall time)")
    return args


def load_cfg(args: argparse.Namespace) -> DoraConfig:
    from dora_megatron.config.schema import load_config

    cfg = load_config(Path(args.config), args.overrides)
    if cfg.rollout.engine != "sglang":
        raise SystemExit(f"{args.config}: rollout.engine is {cfg.rollout.engine!r}; this bench needs sglang")
    need = args.prompt_tokens + max(args.lengths) + 2
    pool = cfg.sglang.max_total_tokens
    if pool is not None and pool < need:
        raise SystemExit(f"sglang.max_total_tokens {pool} < {need} (--prompt-tokens + the longest of --lengths + 2): "
                         f"raise it with --set sglang.max_total_tokens={need}")
    return cfg


def start_servers(cfg: DoraConfig, model_dir: str, procs: ProcessSet, names: tuple[str, ...]) -> list[str]:
    """Start one SGLang server per name (dora's argv and environment) and return their URLs."""
    from dora_megatron.ports import free_ports
    from dora_megatron.rollout.sglang.args import InstanceSpec, server_argv, server_env

    urls = []
    for name, port in zip(names, free_ports(len(names))):
        spec = InstanceSpec(name, model_dir, "127.0.0.1", port, None, 0, cfg.sglang.tp_size, "0", seed=cfg.run.seed)
        procs.start(name, server_argv(spec, cfg.sglang, cfg.rollout), {**server_env(cfg.rollout), **QUICK_STOP_ENV})
        urls.append(f"http://127.0.0.1:{port}")
    return urls


async def wait_ready(engines: list[SGLangEngine], procs: ProcessSet, timeout_s: float) -> float:
    """Seconds until every server answers /health (a clear error with the log tail if one exits)."""
    start = time.monotonic()
    pending = list(engines)
    while pending:
        procs.check_alive()
        pending = [e for e in pending if not await e.client.health(timeout_s=5.0)]
        if pending and time.monotonic() - start > timeout_s:
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {[e.base_url for e in pending]}")
        if pending:
            await asyncio.sleep(1.0)
    return time.monotonic() - start


def cached_tokens(resp: GenerateResponse) -> int:
    return int((resp.raw.get("meta_info") or {}).get("cached_tokens") or 0)


class Timer:
    """Timed ``/generate`` calls through dora's SGLang adapter, with unique rids."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.count = 0

    async def generate(self, engine: SGLangEngine, ids: list[int], new: int) -> tuple[GenerateResponse, float]:
        from dora_megatron.comm.protocol import SamplingParams

        self.count += 1
        sp = SamplingParams(max_new_tokens=new, temperature=self.temperature, ignore_eos=True)
        t = time.perf_counter()
        resp = await engine.generate(ids, sp, rid=f"bench{self.count}", version="0")
        elapsed = time.perf_counter() - t
        if resp.completion_tokens != new:
            raise RuntimeError(f"{engine.base_url}: asked for {new} new tokens (ignore_eos), got {resp.completion_tokens}")
        return resp, elapsed


async def one(timer: Timer, origin: SGLangEngine, dest: SGLangEngine, prompt: list[int], length: int) -> tuple[RepTiming, dict[str, int]]:
    """One repetition at partial length ``length`` (the module doc's steps 1-3)."""
    await timer.generate(origin, prompt, 1)  # prefill P on the origin: its radix cache now holds it
    _, base_s = await timer.generate(origin, prompt, 1)
    full, full_s = await timer.generate(origin, prompt, length + 1)
    resubmit = prompt + list(full.output_ids[:length])
    cold, reprefill_s = await timer.generate(dest, resubmit, 1)
    warm, warm_s = await timer.generate(origin, resubmit, 1)
    timing = RepTiming(len(prompt), length, full_s - base_s, reprefill_s, warm_s)
    return timing, {"dest_cached": cached_tokens(cold), "origin_cached": cached_tokens(warm)}


def check_cache(length: int, tokens: int, caches: list[dict[str, int]]) -> None:
    """The destination re-prefilled (almost) everything and the origin hit its cache: otherwise the
    timings do not measure what they say."""
    for c in caches:
        if c["dest_cached"] > tokens // 2:
            raise RuntimeError(f"length {length}: the destination had {c['dest_cached']} of {tokens} tokens cached")
        if c["origin_cached"] < tokens // 2:
            raise RuntimeError(f"length {length}: the origin's warm resubmission hit only {c['origin_cached']} "
                               f"of {tokens} tokens (radix cache off or evicted?)")


async def measure(args: argparse.Namespace, urls: list[str], procs: ProcessSet, vocab: int, temperature: float) -> dict[str, Any]:
    from dora_megatron.rollout.sglang.engine import SGLangEngine

    engines = [SGLangEngine(u) for u in urls]
    try:
        ready_s = await wait_ready(engines, procs, timeout_s=600.0)
        log.info("servers ready after %.0f s", ready_s)
        origin, dest = engines
        rng = random.Random(args.seed)
        timer = Timer(temperature)

        def prompt() -> list[int]:  # ids above the specials (0-2), distinct per call: no prefix hits
            return [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]

        for length in sorted(args.lengths)[:1]:  # warm-up: first-request allocations, not measured
            await one(timer, origin, dest, prompt(), length)
            await one(timer, dest, origin, prompt(), length)
        reps: dict[int, list[RepTiming]] = {n: [] for n in args.lengths}
        caches: dict[int, list[dict[str, int]]] = {n: [] for n in args.lengths}
        loads: list[float] = []
        for r in range(args.reps):
            order = args.lengths[r % len(args.lengths):] + args.lengths[:r % len(args.lengths)]
            for length in order:
                timing, cache = await one(timer, origin, dest, prompt(), length)
                reps[length].append(timing)
                caches[length].append(cache)
            loads.append(os.getloadavg()[0])
            log.info("repetition %d/%d done (1-min load %.1f)", r + 1, args.reps, loads[-1])
        for length in args.lengths:
            check_cache(length, args.prompt_tokens + length, caches[length])
        return {"ready_s": ready_s, "reps": reps, "caches": caches, "loads": loads}
    finally:
        for e in engines:
            await e.close()


def fmt(s: Spread, scale: float = 1.0, digits: int = 3) -> str:
    return f"{s.median * scale:.{digits}f} ({s.lo * scale:.{digits}f}-{s.hi * scale:.{digits}f})"


def report(args: argparse.Namespace, result: dict[str, Any], cpu_count: int) -> tuple[str, dict[str, Any]]:
    rows = [length_row(result["reps"][n]) for n in sorted(args.lengths)]
    line = fit_line([(t.tokens, t.cost_s) for ts in result["reps"].values() for t in ts])
    loads = result["loads"]
    out = [f"Repetitions: {args.reps} (after a warm-up round); prompt {args.prompt_tokens} tokens; median (min-max) "
           f"over repetitions of values taken within each; 1-min load average {min(loads):.1f}-{max(loads):.1f} "
           f"(median {statistics.median(loads):.1f}) on {cpu_count} cores.",
           "",
           "| partial output (tokens) | re-prefilled tokens | decode on origin (s) | re-prefill on a cold instance, "
           "time to first token (s) | resubmit to origin, cache hit (s) | re-prefill / decode of the same tokens | "
           "re-prefill in origin decode steps | cost vs not moving (ms) | re-prefill over cache hit, per token (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        out.append(f"| {row['partial_tokens']} | {row['reprefill_tokens']} | {fmt(row['decode_s'])} | "
                   f"{fmt(row['reprefill_s'])} | {fmt(row['warm_s'])} | {fmt(row['reprefill_over_decode'], digits=3)} | "
                   f"{fmt(row['reprefill_in_decode_steps'], digits=1)} | {fmt(row['cost_s'], 1e3, 1)} | "
                   f"{fmt(row['extra_s_per_token'], 1e3, 3)} |")
    out += ["", f"Cost vs not moving, least-squares over every repetition: {line.fixed_s * 1e3:.1f} ms per move + "
                f"{line.per_token_s * 1e3:.3f} ms per re-prefilled token."]
    summary: dict[str, Any] = {
        "rows": [{k: (v.to_json() if isinstance(v, Spread) else v) for k, v in row.items()} for row in rows],
        "line": {"fixed_s": line.fixed_s, "per_token_s": line.per_token_s},
        "loads_1min": loads, "ready_s": result["ready_s"], "cpu_count": cpu_count,
    }
    if args.moves is not None:
        est = run_estimate(line, args.moves, args.tokens, args.run_s, 2)
        summary["run_estimate"] = {"moves": args.moves, "tokens": args.tokens, "run_s": args.run_s, **est}
        out.append(f"Estimate for a run with {args.moves} moves re-prefilling {args.tokens} tokens in {args.run_s:.0f} s "
                   f"(2 instances): {est['reprefill_s']:.1f} s of re-prefill, {est['share_of_wall'] * 100:.1f}% of the "
                   f"wall time, {est['share_of_instance_time'] * 100:.2f}% of the instances' time.")
    return "\n".join(out) + "\n", summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    cfg = load_cfg(args)
    from dora_megatron.models import hf_model_dir
    from dora_megatron.models.presets import preset_config
    from dora_megatron.processes import ProcessSet

    # a SIGTERM ends the run through the finally below, which stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench_reprefill_") as tmp:
        model_cfg = preset_config(cfg.model.preset)
        model_dir = hf_model_dir.save_model_dir(Path(tmp) / "model", model_cfg,
                                                hf_model_dir.random_state_dict(model_cfg, args.seed))
        procs = ProcessSet(Path(tmp) / "logs", grace_s=2.0)
        try:
            urls = start_servers(cfg, str(model_dir), procs, ("origin", "dest"))
            result = asyncio.run(measure(args, urls, procs, int(model_cfg["vocab_size"]),
                                         float(cfg.rollout.temperature)))
        except BaseException:
            for child in procs.children:
                log.error("%s log tail:\n%s", child.name, child.tail(20))
            raise
        finally:
            procs.stop_all()
    text, summary = report(args, result, os.cpu_count() or 0)
    sys.stdout.write(text)
    if args.out:
        raw = {str(n): [vars(t) | c for t, c in zip(result["reps"][n], result["caches"][n])] for n in args.lengths}
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "timings": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
