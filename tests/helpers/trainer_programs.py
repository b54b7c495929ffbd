"""Small rank programs that exercise the trainer end to end (tests, tools, GPU smoke).

WHY: multi-rank checks need a program every torchrun rank runs; it is test scaffolding, so it lives
beside the tests (not in the package users install), and the integration tests and the GPU smoke
share it. Run from the repository root as::

    python -m torch.distributed.run --nproc_per_node N -m tests.helpers.trainer_programs \
        step --hf DIR --tp 2 --out result.pt

``step``: parity logits, then one train step on :func:`fixed_batch`, then the exported HF weights.
``resume-save``: step on batch 0, save a checkpoint, steps on batches 1, 2, 3. ``resume-load``: load
the checkpoint, steps on batches 1, 2, 3 (``--warmup``/``--lr-decay``/``--min-lr``/``--total-steps``: the
LR schedule, so each step's ``lr`` differs). ``replay``: batch 0 with the ``routed_experts`` from ``--routing`` (a
``torch.save`` list, one ``[positions, layers, top_k]`` tensor per sample): ``router_topk_agreement``
before replay, log-probs with replay (``--replay``) or without, the routers' chosen experts (1 rank)
and one train step. ``grouping``: the gradients and metrics of one long-tailed batch (:func:`long_tail_batch`)
under each ``--budgets`` value of ``trainer.max_tokens_per_micro_batch`` (0 = ``--micro-batch-size``
rows) and each ``--length-norms`` value, without optimizer steps. ``matrix``: for each ``--items``
entry ``MODEL:key=value,...`` (a model of ``--models`` and ``TrainerConfig`` overrides, see
:func:`parse_item`), built one after another in the same torch.distributed world: parity logits,
log-probs of batch 0, on 1 rank the gradients of one accumulation, then ``train_steps`` optimizer
steps and the exported weights. ``logits``: the parity logits of each checkpoint in ``--ckpt``
(comma-separated; a run's ``checkpoints/vN/trainer``), the trainer's own function of that version, on
:func:`~tests.helpers.trainer_parity.fixed_inputs` (``result["logits"]``: one tensor per checkpoint).
Rank 0 writes a ``torch.save`` dict to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import time
import warnings

import torch

from dora_megatron.comm.train_sample import TrainSample


def fixed_batch(vocab_size: int, seed: int, num_groups: int = 2, group_size: int = 2) -> list[TrainSample]:
    """Deterministic GRPO batch: groups of samples with varied prompt/response lengths and 0/1 rewards."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for grp in range(num_groups):
        prompt = torch.randint(0, vocab_size, (3 + grp,), generator=g).tolist()
        for k in range(group_size):
            n = 4 + (k + grp) % 3
            batch.append(TrainSample(prompt, torch.randint(0, vocab_size, (n,), generator=g).tolist(), version=0,
                                     reward=float((k + grp) % 2), group_id=grp))
    return batch


def long_tail_batch(vocab_size: int, seed: int, response_lengths: tuple[int, ...] = (1, 2, 2, 3, 3, 4, 5, 7, 9, 14,
                                                                                   22, 41)) -> list[TrainSample]:
    """GRPO batch of pairs whose response lengths have a long tail (most short, a few long), in a
    shuffled order, so that grouping by length differs from batch order."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(response_lengths), generator=g).tolist()
    batch = []
    for k, j in enumerate(order):
        prompt = torch.randint(0, vocab_size, (3 + k % 4,), generator=g).tolist()
        response = torch.randint(0, vocab_size, (response_lengths[j],), generator=g).tolist()
        batch.append(TrainSample(prompt, response, version=0, reward=float(j % 3 == 0), group_id=k // 2))
    return batch


def _grouping(worker, vocab: int, budgets: list[int], norms: list[str], noise: float) -> dict:
    """{(length_norm, budget): {"metrics", "grads", "micro_batches"}} for one batch; ``grads`` maps
    every local parameter's name to its reduced ``main_grad`` (with EP, rank 0's local experts are
    global experts ``0..E/ep-1``, so its names match the 1-rank run's)."""
    from dataclasses import replace

    batch = _with_rollout_logprobs(worker, long_tail_batch(vocab, seed=0), noise, seed=0)
    out: dict = {}
    for norm in norms:
        worker.algo = replace(worker.algo, length_norm=norm, length_norm_constant=64 if norm == "constant" else 0)
        for budget in budgets:
            worker.cfg.max_tokens_per_micro_batch = budget
            metrics = worker.accumulate_gradients(batch)
            grads = _local_grads(worker)
            out[(norm, budget)] = {"metrics": metrics, "grads": grads,
                                   "micro_batches": len(worker._plan(batch).micro_batches)}
    return out


def _local_grads(worker) -> dict[str, torch.Tensor]:
    """Every local parameter's reduced ``main_grad`` under its canonical (chunk-local) name."""
    from dora_megatron.weights.naming import canonical_name

    return {canonical_name(name): p.main_grad.detach().float().clone()
            for chunk in worker.chunks for name, p in chunk.named_parameters()}


@contextlib.contextmanager
def _forward_counts(worker):
    """Counts forward calls of every transformer layer and core attention module of the worker."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts = {"layer": 0, "core_attention": 0}
    hooks = []
    for chunk in worker.chunks:
        for name, module in chunk.named_modules():
            kind = "layer" if isinstance(module, TransformerLayer) else (
                "core_attention" if name.endswith("self_attention.core_attention") else None)
            if kind:
                hooks.append(module.register_forward_hook(lambda *_, kind=kind: counts.__setitem__(kind, counts[kind] + 1)))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def parse_item(item: str) -> tuple[str, dict, dict]:
    """``"MODEL:key=value,..."`` -> (model name, TrainerConfig overrides, scenario options).

    Values are YAML (``true``, ``2``, ``bf16``); the options ``train_steps`` (optimizer steps on batch 0,
    default 1) and ``batch`` (``fixed`` or ``zero_advantage``: one group of equal rewards, so every
    gradient is 0) are the scenario's, ``megatron.FIELD`` goes to ``trainer.megatron``, every other key is a
    ``TrainerConfig`` field."""
    from dora_megatron.config.loader import yaml_load

    model, _, rest = item.partition(":")
    overrides: dict = {}
    options = {"train_steps": 1, "batch": "fixed"}
    for pair in filter(None, rest.split(",")):
        key, _, raw = pair.partition("=")
        value = yaml_load(raw)
        if key.startswith("megatron."):
            overrides.setdefault("megatron", {})[key[len("megatron."):]] = value
        else:
            (options if key in options else overrides)[key] = value
    return model, overrides, options


def _matrix_item(cfg, algo, hf_dir: str, options: dict, noise: float) -> dict:
    """One configuration of the ``matrix`` scenario (see :func:`run`)."""
    from tests.helpers.trainer_parity import fixed_inputs, megatron_logits
    from dora_megatron.trainer.worker import TrainerWorker

    worker = TrainerWorker(cfg, algo, hf_dir, total_steps=max(2, options["train_steps"]))
    vocab = worker.arch.vocab_size
    out: dict = {"logits": megatron_logits(worker, fixed_inputs(vocab))}
    if options["batch"] == "zero_advantage":
        batch = [dataclasses.replace(s, reward=1.0, group_id=0) for s in fixed_batch(vocab, seed=0)]
    else:
        batch = fixed_batch(vocab, seed=0)
    out["logprobs"] = worker.compute_logprobs(batch)
    batch = _with_rollout_logprobs(worker, batch, noise, seed=0)
    if worker.info.world_size == 1:
        with _forward_counts(worker) as counts:  # how often layers / core attention ran: recompute shows here
            out["grad_metrics"] = worker.accumulate_gradients(batch)
        out["forward_counts"] = dict(counts)
        out["grads"] = _local_grads(worker)
    out["steps"] = [worker.train_step(batch) for _ in range(options["train_steps"])]
    out["metrics"] = out["steps"][0]
    weights = dict(worker.export_hf_state_dict())
    if worker.info.rank == 0:
        out["weights"] = {k: v.float() for k, v in weights.items()}
    worker.close(keep_world=True)
    return out


def _with_rollout_logprobs(worker, batch: list[TrainSample], noise: float, seed: int) -> list[TrainSample]:
    """Rollout log-probs = trainer log-probs (+ optional deterministic noise to exercise clipping)."""
    lps = worker.compute_logprobs(batch)
    g = torch.Generator().manual_seed(seed)
    for s, lp in zip(batch, lps):
        s.rollout_logprobs = (lp + noise * torch.randn(lp.shape, generator=g)).tolist()
    return batch


def _replay(worker, vocab: int, routing: list, noise: float) -> dict:
    batch = fixed_batch(vocab, seed=0)
    for s, r in zip(batch, routing):
        s.routed_experts = r
    used: dict[int, list] = {}
    hooks = []
    if worker.info.world_size == 1:  # the experts each router really used, in micro-batch order
        for layer, router in worker._routers:
            hooks.append(router.register_forward_hook(
                lambda mod, inp, out, layer=layer: used.setdefault(layer, []).append(out[1].detach().clone())))
    out = {"agreement": worker.router_agreement(batch)}
    used.clear()
    out["logprobs"] = worker.compute_logprobs(batch)
    out["routing_maps"] = dict(used)
    for h in hooks:
        h.remove()
    out["metrics"] = worker.train_step(_with_rollout_logprobs(worker, batch, noise, seed=0))
    return out


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.helpers.trainer_programs")
    parser.add_argument("scenario", choices=("step", "resume-save", "resume-load", "replay", "grouping", "matrix", "logits"))
    parser.add_argument("--items", nargs="*", default=[], help="matrix: MODEL:key=value,... (see parse_item)")
    parser.add_argument("--models", nargs="*", default=[], help="matrix: NAME=HF_DIR for the items' MODEL")
    parser.add_argument("--trainer", default="", help="more TrainerConfig fields, key=value,... (as a matrix item)")
    parser.add_argument("--warmup", type=int, default=0, help="trainer.lr_warmup_steps")
    parser.add_argument("--lr-decay", default="constant", help="trainer.lr_decay")
    parser.add_argument("--min-lr", type=float, default=0.0, help="trainer.min_lr")
    parser.add_argument("--total-steps", type=int, default=0, help="the run's steps (end of the LR decay)")
    parser.add_argument("--budgets", default="0", help="grouping: comma-separated max_tokens_per_micro_batch values")
    parser.add_argument("--length-norms", default="token_mean", help="grouping: comma-separated algo.length_norm values")
    parser.add_argument("--routing", default="")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--hf", default="")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--loss", default="triplet_clip")
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--no-distributed-optimizer", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    from dora_megatron.config.algo import AlgoConfig
    from dora_megatron.config.trainer import TrainerConfig
    from tests.helpers.trainer_parity import fixed_inputs, megatron_logits
    from dora_megatron.trainer.worker import TrainerWorker

    cfg = TrainerConfig(tp=args.tp, pp=args.pp, ep=args.ep, device=args.device, lr=args.lr, adam_eps=args.adam_eps,
                        micro_batch_size=args.micro_batch_size,
                        # the largest budget at build time: with pp > 1 it turns on variable p2p shapes
                        max_tokens_per_micro_batch=max(int(b) for b in args.budgets.split(",")),
                        use_distributed_optimizer=not args.no_distributed_optimizer,
                        lr_warmup_steps=args.warmup, lr_decay=args.lr_decay, min_lr=args.min_lr)
    if args.trainer:
        from dataclasses import replace

        cfg = replace(cfg, **parse_item(":" + args.trainer)[1])
    algo = AlgoConfig(loss=args.loss, tis_cap=args.tis_cap, routing_replay=args.replay)
    if args.scenario == "matrix":
        from dataclasses import replace

        import torch.distributed as dist

        models = dict(m.split("=", 1) for m in args.models)
        results = []
        for item in args.items:
            model, overrides, options = parse_item(item)
            results.append({"item": item, **_matrix_item(replace(cfg, **overrides), algo, models[model], options,
                                                         args.noise)})
        if dist.get_rank() == 0:
            torch.save({"items": results}, args.out)
        dist.destroy_process_group()
        return 0
    worker = TrainerWorker(cfg, algo, args.hf, total_steps=args.total_steps)
    vocab = worker.arch.vocab_size
    result: dict = {"layout": (args.tp, args.pp, args.ep)}
    if args.scenario == "step":
        ids = fixed_inputs(vocab)
        result["logits"] = megatron_logits(worker, ids)
        batch = _with_rollout_logprobs(worker, fixed_batch(vocab, seed=0), args.noise, seed=0)
        t0 = time.perf_counter()
        result["metrics"] = worker.train_step(batch)
        result["step_seconds"] = time.perf_counter() - t0
        result["tokens"] = sum(s.tokens() for s in batch)
    elif args.scenario == "logits":
        ids = fixed_inputs(vocab)
        result["logits"] = []
        for ckpt in [c for c in args.ckpt.split(",") if c]:
            worker.load_checkpoint(ckpt)
            result["logits"].append(megatron_logits(worker, ids))
    elif args.scenario == "grouping":
        result["grouping"] = _grouping(worker, vocab, [int(b) for b in args.budgets.split(",")],
                                       args.length_norms.split(","), args.noise)
    elif args.scenario == "replay":
        result.update(_replay(worker, vocab, torch.load(args.routing), args.noise))
    elif args.scenario == "resume-save":
        result["metrics0"] = worker.train_step(_with_rollout_logprobs(worker, fixed_batch(vocab, 0), args.noise, 0))
        worker.save_checkpoint(args.ckpt)
        result["after"] = [worker.train_step(_with_rollout_logprobs(worker, fixed_batch(vocab, b), args.noise, b))
                           for b in (1, 2, 3)]
        result["metrics"] = result["after"][0]
    else:
        worker.load_checkpoint(args.ckpt)
        result["after"] = [worker.train_step(_with_rollout_logprobs(worker, fixed_batch(vocab, b), args.noise, b))
                           for b in (1, 2, 3)]
        result["metrics"] = result["after"][0]
    weights = dict(worker.export_hf_state_dict())
    if worker.info.rank == 0:
        result["weights"] = weights
        torch.save(result, args.out)
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(run())
