"""Benchmark the embedded engine core on the tiny MoE model (CPU).

1. Decode throughput of the engine (continuous batching scheduler, in process, no HTTP) with
   1, 8, 32, 64 concurrent requests, against Hugging Face ``generate`` on the same weights, one
   request at a time, in the same run (ratio reported).
2. Migration cost (exported bytes, export + import ms) against the cost of re-prefilling the
   same context, at 256 / 1K / 4K tokens.
3. The cost of drawing one token at temperature 1 by vocabulary size (128, the Llama 2 32,000,
   Qwen3's 151,936): ``torch.multinomial`` against the engine's
   :func:`~dora_megatron.rollout.engine.sampler.draw_index` on the same distributions, and the
   engine's whole ``sample_token`` (log-softmax, truncation, draw), interleaved (``sampling``).

Usage: ``python tools/bench_engine.py [--model DIR] [--threads 1] [--new-tokens 128] [--out FILE.json]``
(without ``--model`` a random ``tiny-moe`` directory is created in a temp dir).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def engine_throughput(model, concurrency: int, prompt_len: int, new_tokens: int) -> dict:
    from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
    from dora_megatron.comm.protocol import SamplingParams

    s = Scheduler(model, SchedulerLimits(max_running=max(concurrency, 1)))
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        prompt = [(3 + (i * 7 + j) % 90) for j in range(prompt_len + (i % 8))]
        s.submit(Request(rid=f"r{i}", prompt_ids=prompt, params=sp))
    t0 = time.perf_counter()
    s.step()  # admission + prefill of all requests (+ first token)
    t1 = time.perf_counter()
    while s.can_step():
        s.step()
    t2 = time.perf_counter()
    total = concurrency * new_tokens
    return {
        "concurrency": concurrency,
        "tokens": total,
        "wall_s": t2 - t0,
        "tokens_per_s": total / (t2 - t0),
        "decode_tokens_per_s": (total - concurrency) / (t2 - t1),
    }


def hf_throughput(hf_model, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import torch

    times = []
    for i in range(repeats):
        ids = torch.tensor([[(3 + (i * 7 + j) % 90) for j in range(prompt_len)]])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        times.append(time.perf_counter() - t0)
        assert out.shape[1] == prompt_len + new_tokens
    return {"requests": repeats, "tokens_per_s": new_tokens * repeats / sum(times), "mean_request_s": statistics.mean(times)}


def migration_cost(model, context: int, repeats: int = 3) -> dict:
    import torch

    from dora_megatron.rollout.engine.kv_cache import RequestKV
    from dora_megatron.rollout.engine.scheduler import Request, Scheduler, SchedulerLimits
    from dora_megatron.comm.protocol import SamplingParams

    prompt = [(3 + (j * 13) % 90) for j in range(context - 1)]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    exp_ms, imp_ms, pre_ms, sizes = [], [], [], []
    for r in range(repeats):
        a = Scheduler(model, SchedulerLimits(max_running=1, max_context=context + 8))
        b = Scheduler(model, SchedulerLimits(max_running=1, max_context=context + 8))
        a.submit(Request(rid="m", prompt_ids=prompt, params=sp))
        a.step()  # prefill: KV now holds context-1 tokens, one sampled token pending
        t0 = time.perf_counter()
        blob = a.export_request("m")
        t1 = time.perf_counter()
        b.import_request(blob, None)
        b._admit()
        t2 = time.perf_counter()
        exp_ms.append((t1 - t0) * 1e3)
        imp_ms.append((t2 - t1) * 1e3)
        sizes.append(len(blob))
        # re-prefill: what a migration without KV transfer must recompute (prompt + partial output)
        kv = RequestKV(model.kv_shape(16))
        kv.ensure_capacity(context)
        ids = torch.tensor(prompt + [5])
        t3 = time.perf_counter()
        with torch.inference_mode():
            model.logits(model.forward_segments(ids, torch.arange(len(ids)), [(kv, len(ids))])[-1:])
        pre_ms.append((time.perf_counter() - t3) * 1e3)
    med = statistics.median
    return {
        "context": context,
        "bytes": sizes[0],
        "export_ms": med(exp_ms),
        "import_ms": med(imp_ms),
        "migration_ms": med(exp_ms) + med(imp_ms),
        "reprefill_ms": med(pre_ms),
    }


def sampling_cost(vocab: int, repeats: int) -> dict:
    """Median seconds of one draw from a softmax over ``vocab`` random logits: ``torch.multinomial``,
    the engine's ``draw_index``, and ``sample_token`` at temperature 1, interleaved draw by draw."""
    import torch

    from dora_megatron.comm.protocol import SamplingParams
    from dora_megatron.rollout.engine.sampler import draw_index, make_generator, sample_token

    g = make_generator(0)
    logits = torch.randn(vocab, generator=g) * 3
    probs = torch.softmax(logits, -1)
    params = SamplingParams(temperature=1.0)
    arms = {"multinomial": lambda: int(torch.multinomial(probs, 1, generator=g)),
            "draw_index": lambda: draw_index(probs, g),
            "sample_token": lambda: sample_token(logits, params, g)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(repeats):
        for arm, f in arms.items():
            t0 = time.perf_counter()
            f()
            times[arm].append(time.perf_counter() - t0)
    med = {a: statistics.median(v) for a, v in times.items()}
    return {"vocab": vocab, **{f"{a}_us": round(t * 1e6, 1) for a, t in med.items()},
            "draw_speedup": round(med["multinomial"] / med["draw_index"], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--hf-requests", type=int, default=4)
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--vocabs", default="128,32000,151936", help="vocabulary sizes of the sampling-cost table")
    ap.add_argument("--sampling-repeats", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from dora_megatron.models.presets import create_model_dir
    from dora_megatron.rollout.engine.model import load_model

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(create_model_dir("tiny-moe", tempfile.mkdtemp(prefix="bench-moe-"), 0))
    model = load_model(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine_throughput(model, 2, args.prompt_len, 8)  # warm-up

    results: dict = {"model": model_dir, "threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    hf_res = hf_throughput(hf, args.prompt_len, args.new_tokens, args.hf_requests)
    results["hf_generate_one_at_a_time"] = hf_res
    print(f"HF generate (1 request at a time): {hf_res['tokens_per_s']:.1f} tok/s")
    results["engine"] = []
    for c in (int(x) for x in args.concurrency.split(",")):
        r = engine_throughput(model, c, args.prompt_len, args.new_tokens)
        r["ratio_vs_hf"] = r["tokens_per_s"] / hf_res["tokens_per_s"]
        results["engine"].append(r)
        print(
            f"engine concurrency {c:3d}: {r['tokens_per_s']:8.1f} tok/s (decode {r['decode_tokens_per_s']:8.1f}), "
            f"{r['ratio_vs_hf']:.2f}x HF"
        )
    results["migration"] = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        m = migration_cost(model, ctx)
        results["migration"].append(m)
        print(
            f"migration @ {ctx:5d} tokens: {m['bytes'] / 1e6:7.2f} MB, export {m['export_ms']:.1f} ms + "
            f"import {m['import_ms']:.1f} ms = {m['migration_ms']:.1f} ms vs re-prefill {m['reprefill_ms']:.1f} ms"
        )
    results["sampling"] = []
    for vocab in (int(x) for x in args.vocabs.split(",")):
        c = sampling_cost(vocab, args.sampling_repeats)
        results["sampling"].append(c)
        print(f"sampling @ vocab {vocab:6d}: multinomial {c['multinomial_us']:.1f} us, draw_index "
              f"{c['draw_index_us']:.1f} us ({c['draw_speedup']}x), sample_token {c['sample_token_us']:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
