"""The hand-off of one training step from the controller to the trainer's ranks, old against new.

``python tools/bench_handoff.py --groups 32 --group-size 16 --mean-tokens 2400 --routed-experts 48x8 --dp 16``

WHY: at reasoning lengths a step is millions of tokens; what the hand-off costs decides whether
the controller's event loop keeps running while a batch is released, and how much every trainer
rank reads. Samples are built as the controller's sample store holds them (int32 ids and float32
log-probs as ``array``; routed experts as int8 arrays) with Pareto lengths of the given mean, capped
at ``--max-tokens``. Measured, on this machine:

* ``json``: the old body, ``json.dumps`` of the samples as lists (routed experts as SGLang's base64
  text), then ``json.loads`` by the trainer's rank 0 (every rank then unpickled all of it);
* ``files``: :func:`~dora_megatron.comm.batch_files.write_batch` in a worker thread while a 10 ms
  ticker measures the event loop's lag, then every DP rank's read of its own rows
  (:class:`~dora_megatron.comm.batch_files.BatchReader`, the trainer's plan picks the rows): bytes
  per rank against total / DP, and the slowest rank's read. Hand-off wall = write + slowest read
  (ranks read in parallel on their own nodes; here they are timed one after another).

``--spool`` (with ``--routed-experts``): the routed experts are first written to the run's spool
as the controller does while each sample finishes (:mod:`~dora_megatron.comm.routed_spool`; timed
apart, ``spool_write_s``: spread over the rollout, not part of the hand-off), then the hand-off
writes only the token columns and each rank reads its samples' routed ids from the spool.

Prints one JSON object; ``--skip-json`` leaves the old path out (it needs the whole body in memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dora_megatron.comm.batch_files import BatchReader, decode_batch, write_batch  # noqa: E402
from dora_megatron.comm.routed_spool import SPOOL_DIR, RoutedSpool  # noqa: E402
from dora_megatron.comm.train_sample import TrainSample, decode_train, encode_train  # noqa: E402
from dora_megatron.trainer.packing import plan_step  # noqa: E402


def build(args: argparse.Namespace) -> list[TrainSample]:
    rng = random.Random(0)
    gen = np.random.default_rng(0)
    layers, top_k = (int(x) for x in args.routed_experts.lower().split("x")) if args.routed_experts else (0, 0)
    alpha = 1.5
    scale = args.mean_tokens * (alpha - 1) / alpha  # Pareto mean = scale * alpha / (alpha - 1), before the cap
    pool = gen.integers(0, 128, size=(args.max_tokens + args.prompt_tokens) * max(1, layers * top_k), dtype=np.int8)
    samples = []
    for g in range(args.groups):
        prompt = array("i", gen.integers(0, 150_000, args.prompt_tokens).tolist())
        for _ in range(args.group_size):
            n = max(1, min(args.max_tokens, int(scale * rng.paretovariate(alpha))))
            s = TrainSample(prompt, array("i", gen.integers(0, 150_000, n).astype(np.int32).tobytes()),
                            array("f", (-gen.exponential(0.25, n)).astype(np.float32).tobytes()), version=0,
                            reward=float(rng.random() < 0.5), group_id=f"g{g}")
            if layers:
                s.routed_experts = pool[:(args.prompt_tokens + n - 1) * layers * top_k]
            samples.append(s)
    return samples


async def write_with_lag(directory: Path, samples: list[TrainSample]) -> tuple[dict, float, float]:
    lags: list[float] = []

    async def tick() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)

    ticker = asyncio.get_running_loop().create_task(tick())
    t0 = time.monotonic()
    entry = await asyncio.to_thread(write_batch, directory, samples)
    wall = time.monotonic() - t0
    ticker.cancel()
    return entry, wall, max(lags, default=0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--mean-tokens", type=int, default=2400)
    p.add_argument("--max-tokens", type=int, default=30000)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--routed-experts", default="", metavar="LAYERSxTOPK")
    p.add_argument("--dp", type=int, default=16)
    p.add_argument("--dir", default="", help="where the batch directory goes (default: a temporary one)")
    p.add_argument("--skip-json", action="store_true")
    p.add_argument("--spool", action="store_true", help="routed experts spooled before the hand-off (as the controller does)")
    args = p.parse_args(argv)
    samples = build(args)
    tokens = sum(s.tokens() for s in samples)
    out: dict = {"samples": len(samples), "tokens": tokens, "routed_experts": args.routed_experts or None,
                 "dp": args.dp}
    if not args.skip_json:
        t0 = time.monotonic()
        body = encode_train(0, samples)  # the /train body without a batch directory
        out["json_encode_s"] = time.monotonic() - t0
        out["json_bytes"] = len(body)
        t0 = time.monotonic()
        decode_train(json.loads(body))  # as the trainer's service reads it
        out["json_decode_s"] = time.monotonic() - t0
        del body
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_handoff_"))
    try:
        if args.spool and args.routed_experts:
            spool = RoutedSpool(work / SPOOL_DIR)
            t0 = time.monotonic()
            for s in samples:
                s.routed_experts = spool.put(s.routed_experts)
            spool.flush()
            out.update({"spool_write_s": time.monotonic() - t0,
                        "spool_bytes": sum(f.stat().st_size for f in (work / SPOOL_DIR).iterdir())})
        entry, write_s, lag = asyncio.run(write_with_lag(work / "step_000000", samples))
        out["files_write_s_includes_routed"] = not args.spool
        out.update({"files_write_s": write_s, "loop_lag_max_during_write_ms": lag * 1000,
                    "files_bytes": sum(f.stat().st_size for f in (work / "step_000000").glob("*.npy")),
                    "request_bytes": len(json.dumps({"step": 0, "batch": entry}))})
        lengths = [s["prompt_tokens"] + s["response_tokens"] for s in entry["samples"]]
        per_rank, seconds, seen = [], [], []
        for rank in range(args.dp):
            t0 = time.monotonic()
            reader = BatchReader(decode_batch(entry))
            plan = plan_step(lengths, dp=args.dp, dp_rank=rank, micro_batch_size=1, max_tokens=32768)
            rows = sorted({i for mb in plan.micro_batches for i in mb.rows if i >= 0})
            reader.samples(rows)
            seconds.append(time.monotonic() - t0)
            per_rank.append(reader.bytes_read)
            seen += rows
        fair = (out["files_bytes"] + out.get("spool_bytes", 0)) / args.dp
        out.update({"rank_bytes_max": max(per_rank), "rank_bytes_min": min(per_rank),
                    "rank_bytes_max_over_fair_share": max(per_rank) / fair, "rank_read_s_max": max(seconds),
                    "rows_read_exactly_once": sorted(seen) == list(range(len(samples))),
                    "handoff_wall_s": write_s + max(seconds)})
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
