"""Benchmark speculative decoding of the embedded engine on the main job's warm-started model (CPU).

Side by side in one run, on the same weights, in process (the scheduler, no HTTP), temperature 1:

1. Lone long-tail requests (``--temperature``, default 1): each prompt of the task's longest lists is decoded alone with
   ``speculative`` off, ``ngram`` and ``group`` (the group's siblings, sampled beforehand, are its
   drafts), interleaved prompt by prompt so that load drift hits every mode alike. Reported: tokens
   per second of each mode, ``lone_request_speedup`` (each mode against off) and the tokens a
   verify step kept. ``group`` gets the siblings from another instance and scores them itself
   (``rollout.spec_sibling_top_k``) in the timed decode; ``group_siblings_here`` runs on the
   instance that decoded the siblings (untimed, just before), which kept the distributions it drew
   them from: no scoring forward.
2. Step costs: one forward of a lone request over 1..k+1 positions, relative to a decode step,
   with the engine's MoE path and with the per-expert path alone (``step_costs``).
3. What bounds the lone request here (``draft_bound``): along sampled answers, the target's
   entropy and top-1 probability (which bound a fixed draft token's acceptance), the engine's
   sibling draft's kept rate ``sum(min(p, q))``, what two candidates from ``q`` would keep, and the
   per-token acceptance a verify step at its measured cost needs for a 1.5x speedup.
4. The distribution test: many samples of one prompt without speculation, with ``ngram`` drafts
   and with ``group`` drafts (drawn from the siblings); for each of the first ``--test-positions``
   output positions a two-sample chi-square test of the token there against the samples without
   (cells with fewer than 10 pooled samples merged); each arm's p-value is its smallest times the
   number of positions, and ``distribution_p_value`` the smaller arm's times two (Bonferroni), a
   valid p-value for "all those marginals are equal". Speculation is exact, so it should be
   unremarkable (above 0.01 in 99% of seeds).

Usage: ``python tools/bench_speculative.py [--model DIR] [--out FILE.json]``. Without ``--model``
the main job's model is built as ``configs/cpu_tiny.yaml`` builds it: ``tiny-moe`` (seed 1234),
warm-started on ``digit_cipher`` for 150 steps (a few minutes on one core); ``--model-cache DIR``
keeps it for later runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench_speculative")

MODES = ("off", "ngram", "group")


def build_model(out: Path, seed: int, steps: int) -> Path:
    from dora_megatron.models.presets import create_model_dir
    from dora_megatron.models.warm_start import run_warm_start

    if (out / "config.json").exists():
        log.info("using the model in %s", out)
        return out
    create_model_dir("tiny-moe", out, seed)
    run_warm_start(out, "digit_cipher", steps, seed=seed, task_kwargs={"min_len": 1, "max_len": 40})
    return out


def tail_prompts(n: int, seed: int, min_digits: int) -> list[list[int]]:
    """Token ids of the first ``n`` prompts of the job's stream with at least ``min_digits`` digits."""
    from dora_megatron.data import tokenizer as tok
    from dora_megatron.data.tasks import RunningSumTask

    task = RunningSumTask(min_len=1, max_len=40, exponent=1.2, seed=seed, kind="digit_cipher")
    out, i = [], 0
    while len(out) < n:
        if len(task.digits(i)) >= min_digits:
            out.append(tok.encode(task.get(i).text, add_bos=True))
        i += 1
    return out


def decode(model, reqs, mode: str, spec: dict, spec_max_batch: int, before=None) -> tuple[dict, dict, float]:
    """Run ``reqs`` (Request objects) to completion on a fresh scheduler; (responses, stats, seconds).
    ``spec``: the ``SchedulerLimits`` speculation keys (``spec_tokens`` and the per-request policy's);
    ``before(scheduler)``: runs on the scheduler first, untimed, and returns the requests' draft
    sources (the siblings it decoded there)."""
    from dora_megatron.rollout.engine.scheduler import Scheduler, SchedulerLimits

    s = Scheduler(model, SchedulerLimits(max_running=max(len(reqs), 8 if before else 1), speculative=mode,
                                         spec_max_batch=spec_max_batch, **spec))
    if before is not None:
        sources = before(s)
        for r in reqs:
            r.draft_sources = [list(x) for x in sources]
    out: dict = {}
    for r in reqs:
        r.on_done = lambda resp: out.__setitem__(resp["meta_info"]["id"], resp)
        s.submit(r)
    t0 = time.perf_counter()
    while s.can_step():
        s.step()
    return out, s.info(), time.perf_counter() - t0


def request(rid: str, prompt: list[int], seed: int, max_new: int, sources=(), temperature: float = 1.0):
    from dora_megatron.comm.protocol import SamplingParams
    from dora_megatron.rollout.engine.scheduler import Request

    return Request(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                                                           sampling_seed=seed),
                   draft_sources=[list(s) for s in sources])


#: the lone-request arms: the engine's modes, and ``group`` on the instance that decoded the
#: siblings (it kept the distributions it drew them from, so no scoring forward)
LONE_ARMS = (*MODES, "group_siblings_here")


def lone_requests(model, prompts, group_size: int, max_new: int, spec: dict, repeats: int,
                  temperature: float) -> dict:
    arms = LONE_ARMS if temperature > 0 and spec.get("spec_sibling_top_k", 0) > 0 else MODES
    tokens = {m: 0 for m in arms}
    seconds = {m: 0.0 for m in arms}
    stats = {m: {"verify_steps": 0, "accepted": 0, "verify_tokens": 0, "declined": 0, "scored": 0, "recorded": 0}
             for m in arms if m != "off"}
    for p_i, prompt in enumerate(prompts):
        sibs, _, _ = decode(model, [request(f"s{j}", prompt, 10_000 + 97 * p_i + j, max_new, (), temperature)
                                    for j in range(group_size - 1)], "off", spec, 1)
        sources = [prompt + r["output_ids"] for r in sibs.values()]

        def siblings_here(sched, p_i=p_i, prompt=prompt):
            """The same siblings decoded on the tail's instance (speculative: group records them)."""
            got: dict = {}
            for j in range(group_size - 1):
                r = request(f"s{j}", prompt, 10_000 + 97 * p_i + j, max_new, (), temperature)
                r.on_done = lambda resp: got.__setitem__(resp["meta_info"]["id"], resp)
                sched.submit(r)
            while sched.can_step():
                sched.step()
            return [prompt + got[f"s{j}"]["output_ids"] for j in range(group_size - 1)]

        for rep in range(repeats):
            for arm in arms:
                seed = 7 * p_i + rep
                mode, before = ("group", siblings_here) if arm == "group_siblings_here" else (arm, None)
                resp, info, wall = decode(model, [request("tail", prompt, seed, max_new, sources, temperature)], mode,
                                          spec, 1, before)
                tokens[arm] += len(resp["tail"]["output_ids"])
                seconds[arm] += wall
                if arm != "off":
                    stats[arm]["verify_steps"] += info["spec_verify_steps"]
                    stats[arm]["accepted"] += info["spec_accepted_tokens"]
                    stats[arm]["verify_tokens"] += info["spec_verify_tokens"]
                    stats[arm]["declined"] += info["spec_declined_steps"]
                    stats[arm]["scored"] += info["spec_scored_tokens"]
                    stats[arm]["recorded"] += info["spec_recorded_sources"]
    rate = {m: tokens[m] / seconds[m] for m in arms}
    per_mode = {}
    for m in arms:
        row = {"tokens": tokens[m], "seconds": round(seconds[m], 3), "tokens_per_s": round(rate[m], 1),
               "speedup": round(rate[m] / rate["off"], 3)}
        if m in stats:
            v = stats[m]["verify_steps"]
            row["accepted_tokens_per_step"] = round(stats[m]["accepted"] / v, 3) if v else 0.0
            row["tokens_per_verify_step"] = round(stats[m]["verify_tokens"] / v, 3) if v else 0.0
            row["verify_steps"] = v
            row["declined_steps"] = stats[m]["declined"]  # decode steps the policy chose not to draft
            row["scored_tokens"] = stats[m]["scored"]  # sibling tokens the scoring forwards computed
            row["recorded_sources"] = stats[m]["recorded"]  # siblings whose distributions the instance kept
        per_mode[m] = row
    return per_mode


def step_costs(model, prompt: list[int], max_positions: int, repeats: int) -> dict:
    """Seconds of one forward of a lone request over 1..``max_positions`` new positions (a decode
    step; a verify step of n - 1 draft tokens), and each relative to the decode step: what
    ``rollout.spec_token_cost`` models. Two MoE paths side by side, interleaved: the engine's
    (all experts at once for small steps, :data:`~dora_megatron.rollout.engine.model.DENSE_EXPERT_MACS`)
    and the per-expert path alone (each layer's ``all_experts_max_tokens`` set to 0)."""
    import statistics

    import torch

    from dora_megatron.rollout.engine.kv_cache import RequestKV
    from dora_megatron.rollout.engine.model import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    bound = {m: m.all_experts_max_tokens for m in layers}
    paths = {"engine": bound, "per_expert": {m: 0 for m in layers}}
    ids = torch.tensor(list(prompt) + list(prompt[:1]) * max_positions)  # the new positions' tokens do not matter
    kv = RequestKV(model.kv_shape(16))
    kv.ensure_capacity(len(ids))
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in range(1, max_positions + 1)} for p in paths}
    try:
        with torch.inference_mode():
            model.forward_segments(ids[: len(prompt)], torch.arange(len(prompt)), [(kv, len(prompt))])
            for _ in range(repeats):
                for path, max_tokens in paths.items():
                    for m in layers:
                        m.all_experts_max_tokens = max_tokens[m]
                    for n in range(1, max_positions + 1):
                        kv.truncate(len(prompt))
                        t0 = time.perf_counter()
                        h = model.forward_segments(ids[len(prompt) : len(prompt) + n],
                                                   torch.arange(len(prompt), len(prompt) + n), [(kv, n)])
                        model.logits(h)
                        times[path][n].append(time.perf_counter() - t0)
    finally:
        for m in layers:
            m.all_experts_max_tokens = bound[m]
    out = {}
    for path, by_n in times.items():
        med = {n: statistics.median(v) for n, v in by_n.items()}
        out[path] = {"seconds": {n: round(t, 6) for n, t in med.items()},
                     "relative_to_decode": {n: round(t / med[1], 3) for n, t in med.items()}}
    out["decode_speedup_of_engine_path"] = round(out["per_expert"]["seconds"][1] / out["engine"]["seconds"][1], 3)
    return out


def two_candidate_kept(p, q: dict[int, float]) -> float:
    """Probability that one of two draft tokens drawn from ``q`` without replacement is kept by
    recursive rejection sampling (the first with ``min(1, p/q)``; after a rejection the second
    against the residual ``max(p - q, 0)`` normalised, with ``q`` renormalised without the first):
    what the first level of a draft tree of width 2 keeps, against ``sum(min(p, q))`` for one."""
    import torch

    toks = torch.tensor(sorted(q))
    qv = torch.tensor([q[int(t)] for t in toks], dtype=torch.float64)
    pv = p.to(torch.float64)
    residual = (pv.clone().index_put_((toks,), (pv[toks] - qv).clamp_min(0.0)))
    mass = float(residual.sum())
    total = 0.0
    for i, t in enumerate(toks.tolist()):
        first = min(1.0, float(pv[t]) / float(qv[i]))
        second = 0.0
        rest = float(qv.sum() - qv[i])
        if first < 1.0 and mass > 0 and rest > 0:
            q2 = qv / rest
            q2[i] = 0.0
            second = float(torch.minimum(residual[toks] / mass, q2).sum())
        total += float(qv[i]) * (first + (1.0 - first) * second)
    return total


def draft_bound(model, prompts, group_size: int, max_new: int, spec: dict, temperature: float, verify_cost: float,
                target_speedup: float = 1.5) -> dict:
    """What bounds the lone request's speedup here: along sampled answers (each of a group's
    ``group_size`` answers in turn, the others its siblings), the target distribution ``p`` of
    every output position against what any drafter could get kept there.

    - ``entropy_nats`` and ``top1_probability``: a fixed draft token ``d`` is kept with ``p(d)``,
      so the top-1 probability bounds every deterministic drafter's per-token acceptance;
    - ``sibling_kept_rate``: the sampled sibling draft from the counts of the siblings' tokens
      (``rollout.spec_sibling_top_k: 0``), ``sum(min(p, q))`` with ``q`` the engine's own
      :class:`SiblingIndex` distribution, where one exists (``sibling_coverage``);
    - ``scored_sibling_kept_rate``: the same with the siblings scored (the engine's
      ``score_sources`` at ``spec_sibling_top_k``), where a ``q`` exists (``scored_coverage``);
    - ``two_candidate_kept_rate``: two candidates from ``q`` (a draft tree of width 2 at its
      first level, twice the verify positions);
    - ``needed``: the tokens per verify step and the per-token acceptance a verify step costing
      ``verify_cost`` decode steps (``step_costs`` at ``spec_tokens`` + 1 positions) needs for
      ``target_speedup``."""
    import torch

    from dora_megatron.comm.protocol import SamplingParams
    from dora_megatron.rollout.engine.drafter import SiblingIndex, sibling_source
    from dora_megatron.rollout.engine.kv_cache import RequestKV
    from dora_megatron.rollout.engine.sibling_scores import score_sources
    from dora_megatron.rollout.speculation import expected_tokens_per_verify

    n = 0
    sums = {"entropy": 0.0, "top1": 0.0, "sibling": 0.0, "two": 0.0, "covered": 0, "scored": 0.0, "scored_covered": 0}
    params = SamplingParams(temperature=temperature)
    top_k = spec.get("spec_sibling_top_k", 32)
    for p_i, prompt in enumerate(prompts):
        group, _, _ = decode(model, [request(f"g{j}", prompt, 30_000 + 97 * p_i + j, max_new, (), temperature)
                                     for j in range(group_size)], "off", spec, group_size)
        seqs = [prompt + r["output_ids"] for r in group.values()]
        prompt_kv = RequestKV(model.kv_shape(16))
        prompt_kv.ensure_capacity(len(prompt))
        with torch.inference_mode():
            model.forward_segments(torch.tensor(prompt), torch.arange(len(prompt)), [(prompt_kv, len(prompt))])
        sources = [sibling_source(prompt, s) for s in seqs]
        dists, _ = score_sources(model, prompt_kv, prompt, sources, params, top_k) if top_k else ([], 0)
        for j, seq in enumerate(seqs):
            index = SiblingIndex([s for i, s in enumerate(seqs) if i != j])
            scored = SiblingIndex([s for i, s in enumerate(sources) if i != j],
                                  dists=[d for i, d in enumerate(dists) if i != j]) if top_k else None
            kv = RequestKV(model.kv_shape(len(seq) // 16 + 2))
            kv.ensure_capacity(len(seq))
            with torch.inference_mode():
                hidden = model.forward_segments(torch.tensor(seq), torch.arange(len(seq)), [(kv, len(seq))])
                logp = torch.log_softmax(model.logits(hidden[len(prompt) - 1 : -1]).float() / temperature, dim=-1)
            for t, row in zip(range(len(prompt), len(seq)), logp):
                p = row.exp()
                n += 1
                sums["entropy"] -= float((p * row).sum())
                sums["top1"] += float(p.max())
                qs = scored.next_distribution(seq[:t]) if scored is not None else None
                if qs is not None:
                    sums["scored_covered"] += 1
                    sums["scored"] += sum(min(float(p[tok]), w) for tok, w in qs.items())
                q = index.next_distribution(seq[:t])
                if q is None:
                    continue
                sums["covered"] += 1
                sums["sibling"] += sum(min(float(p[tok]), w) for tok, w in q.items())
                sums["two"] += two_candidate_kept(p, q)
    k = spec["spec_tokens"]
    tokens_needed = target_speedup * verify_cost
    lo, hi = 0.0, 1.0  # the acceptance whose expected yield at k draft tokens is tokens_needed
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_verify(k, mid) < tokens_needed else (lo, mid)
    return {
        "answers": len(prompts) * group_size, "positions": n, "temperature": temperature,
        "entropy_nats": round(sums["entropy"] / n, 3), "top1_probability": round(sums["top1"] / n, 3),
        "sibling_coverage": round(sums["covered"] / n, 3),
        "sibling_kept_rate": round(sums["sibling"] / max(sums["covered"], 1), 3),
        "two_candidate_kept_rate": round(sums["two"] / max(sums["covered"], 1), 3),
        "spec_sibling_top_k": top_k,
        "scored_coverage": round(sums["scored_covered"] / n, 3),
        "scored_sibling_kept_rate": round(sums["scored"] / max(sums["scored_covered"], 1), 3),
        "needed": {"speedup": target_speedup, "verify_cost": verify_cost,
                   "tokens_per_verify_step": round(tokens_needed, 3),
                   # None: more than k + 1 tokens per verify step, out of reach at any acceptance
                   "per_token_acceptance": None if tokens_needed >= k + 1 else round(hi, 3)},
    }


def chi2_sf(stat: float, df: int) -> float:
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_pvalue(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that samples ``a`` and ``b`` come from one distribution (rare cells merged)."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cells, other = [], [0, 0]
    for t in set(ca) | set(cb):
        if ca[t] + cb[t] >= min_count:
            cells.append([ca[t], cb[t]])
        else:
            other[0] += ca[t]
            other[1] += cb[t]
    if sum(other) > 0:
        cells.append(other)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return chi2_sf(stat, len(cells) - 1)


def distribution_test(model, prompt, samples: int, positions: int, spec: dict, batch: int, group_size: int) -> dict:
    """Token at each of the first ``positions`` output positions, sampled without speculation, with
    ``ngram`` drafts (a fixed guess, the point-mass rule) and with ``group`` drafts (drawn from
    ``group_size - 1`` siblings sampled beforehand, the general rule)."""
    sibs, _, _ = decode(model, [request(f"s{j}", prompt, 20_000 + j, positions + 8) for j in range(group_size - 1)],
                        "off", spec, batch)
    sources = [prompt + r["output_ids"] for r in sibs.values()]
    outputs: dict[str, list[list[int]]] = {}
    verify = {}
    for arm, mode in enumerate(("off", "ngram", "group")):
        outs: list[list[int]] = []
        stats = {"spec_verify_steps": 0, "spec_accepted_tokens": 0}
        for start in range(0, samples, batch):
            n = min(batch, samples - start)
            reqs = [request(f"d{start + i}", prompt, (1 << 40) + (start + i) * 3 + arm, positions,
                            sources if mode == "group" else ()) for i in range(n)]
            resp, info, _ = decode(model, reqs, mode, spec, batch)
            outs.extend(r["output_ids"] for r in resp.values())
            for k in stats:
                stats[k] += info[k]
        outputs[mode] = outs
        verify[mode] = stats
    result: dict = {"samples_per_arm": samples, "positions": positions}
    for mode in ("ngram", "group"):
        pvals = []
        for pos in range(positions):
            a = [o[pos] for o in outputs["off"] if len(o) > pos]
            b = [o[pos] for o in outputs[mode] if len(o) > pos]
            pvals.append(two_sample_pvalue(a, b))
        result[mode] = {"per_position_p": [round(p, 4) for p in pvals], "p_value": min(1.0, positions * min(pvals)),
                        **verify[mode]}
    # Bonferroni over the two arms: one valid p-value for "speculation changes no marginal"
    result["p_value"] = min(1.0, 2 * min(result["ngram"]["p_value"], result["group"]["p_value"]))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: build the main job's model)")
    ap.add_argument("--model-cache", default=None, help="where to build (and later reuse) the default model")
    ap.add_argument("--seed", type=int, default=1234, help="model seed and prompt stream seed (cpu_tiny's run.seed)")
    ap.add_argument("--warm-start-steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6, help="long-tail prompts decoded alone")
    ap.add_argument("--min-digits", type=int, default=30, help="a long-tail prompt has at least this many digits")
    ap.add_argument("--repeats", type=int, default=2, help="decodes of each prompt per mode")
    ap.add_argument("--group-size", type=int, default=8, help="the group: group-size - 1 finished siblings")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="cpu_tiny's rollout.max_new_tokens")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--spec-token-cost", type=float, default=0.1,
                    help="rollout.spec_token_cost of the per-request policy, cpu_tiny's by default "
                         "(0: always draft, the policy off)")
    ap.add_argument("--spec-probe-interval", type=int, default=64, help="rollout.spec_probe_interval")
    ap.add_argument("--spec-sibling-top-k", type=int, default=32,
                    help="rollout.spec_sibling_top_k (0: group draws from the counts of the siblings' tokens)")
    ap.add_argument("--cost-repeats", type=int, default=200, help="timed forwards per step size and MoE path")
    ap.add_argument("--test-samples", type=int, default=2000, help="samples per arm of the distribution test")
    ap.add_argument("--test-positions", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="of the lone requests (the distribution test is always at 1)")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(args.threads)
    from dora_megatron.rollout.engine.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(args.model_cache or tmp) / "model",
                                                                     args.seed, args.warm_start_steps)
        model = load_model(str(model_dir))
        gc.collect()
        gc.freeze()  # as ``dora serve`` does once its model is loaded
        prompts = tail_prompts(args.prompts, args.seed, args.min_digits)
        spec = {"spec_tokens": args.spec_tokens, "spec_token_cost": args.spec_token_cost,
                "spec_probe_interval": args.spec_probe_interval, "spec_sibling_top_k": args.spec_sibling_top_k}
        costs = step_costs(model, prompts[0], args.spec_tokens + 1, args.cost_repeats)
        lone = lone_requests(model, prompts, args.group_size, args.max_new_tokens, spec, args.repeats, args.temperature)
        # the distribution test drafts at every step (a free draft token): the most verify steps, the most power
        bound = None if args.temperature == 0 else draft_bound(  # greedy drafts are kept whole or not at all
            model, prompts, args.group_size, args.max_new_tokens, spec, args.temperature,
            costs["engine"]["relative_to_decode"][args.spec_tokens + 1])
        dist = distribution_test(model, prompts[0], args.test_samples, args.test_positions,
                                 {**spec, "spec_token_cost": 0.0}, 64, args.group_size)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": str(args.model or f"tiny-moe seed {args.seed}, digit_cipher warm start {args.warm_start_steps} steps"),
        "threads": args.threads, **spec, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "prompts": args.prompts, "min_digits": args.min_digits, "repeats": args.repeats,
        "step_costs": costs,
        "lone": lone,
        "lone_request_speedup": {m: row["speedup"] for m, row in lone.items() if m != "off"},
        "accepted_tokens_per_step": {m: row["accepted_tokens_per_step"] for m, row in lone.items() if m != "off"},
        "draft_bound": bound,
        "distribution_test": dist,
        "distribution_p_value": dist["p_value"],
    }
    text = json.dumps(result, indent=2)
    log.info("result:\n%s", text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
