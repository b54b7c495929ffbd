#!/usr/bin/env python
"""Weight-sync benchmark: throughput (MB/s) and time per version, by transport and bucket size.

    python tools/bench_weights.py [--models tiny,0.5b] [--buckets 16,64,256] [--repeats 2] [--out FILE.json]

Starts an embedded engine (CPU) on the model; then, per model:

- ``distributed``: :func:`dora_megatron.weights.transport.push_distributed` from this process (the
  trainer side, rank 0) to engine A over gloo, once per bucket size (group set-up included in the
  time; ``connect_s`` reported separately);
- ``disk``: :func:`dora_megatron.weights.snapshots.write_snapshot` (trainer side) then engine A's
  ``/update_weights_from_disk`` (time per version = write + load).

After each sync the engine's checksum is compared with the pushed weights' checksum (not timed).
Models: ``tiny`` = the ``tiny-moe`` preset (fp32); ``0.5b`` = a random Qwen3 dense model with
hidden 1024, 24 layers, 16 heads (8 KV, head_dim 128, as Qwen3-0.6B), intermediate 3072,
vocab 32768, bf16 (0.44 B parameters, 0.84 GB). Numbers on a shared CPU box are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("bench_weights")


def make_model(kind: str, out: Path, seed: int) -> tuple[Path, str]:
    """Write a random HF model dir; returns (dir, engine dtype)."""
    import torch

    from dora_megatron.models import hf_model_dir
    from dora_megatron.models.presets import preset_config

    if kind == "tiny":
        cfg, dtype = preset_config("tiny-moe"), "float32"
    elif kind == "0.5b":
        cfg, dtype = preset_config("tiny-dense"), "bfloat16"
        cfg.update(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   intermediate_size=3072, vocab_size=32768, torch_dtype="bfloat16", dtype="bfloat16",
                   layer_types=["full_attention"] * 24, max_window_layers=24)
    else:
        raise ValueError(f"unknown model {kind!r}")
    state = hf_model_dir.random_state_dict(cfg, seed)
    if dtype == "bfloat16":
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    hf_model_dir.save_model_dir(out, cfg, state)
    return out, dtype


async def _checksum(url: str) -> str:
    from dora_megatron.comm.engine_client import EngineClient

    async with EngineClient(url) as c:
        return await c.weights_checksum()


def bench_model(kind: str, buckets: list[float], repeats: int, root: Path) -> list[dict]:
    from dora_megatron.models import hf_model_dir
    from dora_megatron.rollout.engine.process import start_engine
    from dora_megatron.comm.checksum import weights_checksum
    from dora_megatron.weights.snapshots import SnapshotStore
    from dora_megatron.weights.transport import push_disk, push_distributed

    base, dtype = make_model(kind, root / f"{kind}-base", 0)
    new_dir, _ = make_model(kind, root / f"{kind}-new", 1)
    tensors = hf_model_dir.load_state_dict(new_dir)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    nparams = sum(t.numel() for t in tensors.values())
    expected = weights_checksum(tensors)
    log.info("%s: %d tensors, %.1f M params, %.1f MB (%s)", kind, len(tensors), nparams / 1e6, nbytes / 2**20, dtype)
    engine = start_engine(str(base), max_running=1, num_threads=1, extra_args=["--dtype", dtype], timeout_s=600)
    rows: list[dict] = []
    version = 0

    def row(transport: str, bucket_mb, seconds: float, moved: int, extra: dict | None = None) -> None:
        r = {"model": kind, "params_m": round(nparams / 1e6, 1), "model_mb": round(nbytes / 2**20, 1),
             "transport": transport, "bucket_mb": bucket_mb, "seconds": round(seconds, 3),
             "mb_per_s": round(moved / 2**20 / seconds, 1) if seconds > 0 else None, **(extra or {})}
        rows.append(r)
        print(json.dumps(r), flush=True)

    try:
        a = engine.url
        for bucket in buckets:
            for _ in range(repeats):
                version += 1
                res = push_distributed(tensors, [a], bucket, version, timeout_s=600, compute_checksum=False)
                assert asyncio.run(_checksum(a)) == expected, "distributed: checksum mismatch"
                row("distributed", bucket, res.seconds, res.bytes,
                    {"connect_s": round(res.connect_seconds, 3), "buckets": res.num_buckets})
        store = SnapshotStore(root / f"{kind}-snapshots")
        for _ in range(repeats):
            version += 1
            t0 = time.perf_counter()
            store.write(version, tensors, new_dir)
            write_s = time.perf_counter() - t0
            res = asyncio.run(push_disk(str(store.path(version)), [a], version))
            assert asyncio.run(_checksum(a)) == expected, "disk: checksum mismatch"
            row("disk", None, write_s + res.seconds, nbytes, {"write_s": round(write_s, 3), "load_s": round(res.seconds, 3)})
            store.prune(version)
    finally:
        engine.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,0.5b", help="comma list of: tiny, 0.5b")
    parser.add_argument("--buckets", default="16,64,256", help="bucket sizes in MB for the distributed transport")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--workdir", default=None,
                        help="folder under which the model dirs and snapshots go, in a temp dir removed at the end "
                             "(created if missing; default: the system temp folder)")
    args = parser.parse_args(argv)
    if args.workdir:
        # a folder named for the bench's scratch space is expected to be made, as --out's file is
        workdir = Path(args.workdir)
        if workdir.exists() and not workdir.is_dir():
            parser.error(f"--workdir {args.workdir}: exists and is not a folder")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            parser.error(f"--workdir {args.workdir}: cannot create it ({err.strerror or err})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    torch.set_num_threads(1)
    buckets = [float(x) for x in args.buckets.split(",") if x]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for kind in [m for m in args.models.split(",") if m]:
            rows += bench_model(kind, buckets, args.repeats, Path(tmp))
    print(f"\n{'model':6} {'transport':12} {'bucket MB':>9} {'s/version':>10} {'MB/s':>8}")
    for r in rows:
        print(f"{r['model']:6} {r['transport']:12} {str(r['bucket_mb'] or '-'):>9} {r['seconds']:>10.3f} "
              f"{r['mb_per_s'] or 0:>8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
