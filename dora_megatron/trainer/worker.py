"""``TrainerWorker``: one torchrun rank of the Megatron-Core trainer.

WHY: the runtime needs a small, rank-local object with five verbs (recompute log-probs, train one
step, export HF weights, save, load) and must not know about Megatron. Every rank of the job
constructs a worker with the same configs and calls the same verbs with the same batch (each rank
picks its data-parallel share itself); results that only exist on some ranks (loss on the last
pipeline stage, exported weights on rank 0) are documented per method.

Training uses Megatron's own machinery end to end: ``get_forward_backward_func`` (micro-batches,
pipeline schedule), Megatron DDP (+ distributed optimizer) and ``get_megatron_optimizer``; the loss
is reported per token (``calculate_per_token_loss``) so normalisation is exact over the global
batch whatever the micro-batch split.

Batch format: a list of samples, each a mapping or an object with ``prompt_ids`` (list[int]),
``response_ids`` (list[int]), ``rollout_logprobs`` (list[float], one per response token; optional
for ``compute_logprobs``), and either ``advantage`` (float) or ``reward`` (float) with ``group_id``
(hashable); ``version`` is optional and only logged; ``ref_logprobs`` (one per response token) is
required only when ``algo.kl_coef > 0`` (the trainer holds no reference model). Sequences are right-padded to the longest
sample of the step (rounded up to a multiple of TP when sequence parallelism is on).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.trainer import TrainerConfig

logger = logging.getLogger(__name__)

METRIC_KEYS = ("pg_loss", "entropy", "clip_fraction", "rollout_vs_trainer_logprob_diff", "kl", "tis_weight",
               "approx_kl_behaviour")


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, dict):
        return sample.get(name, default)
    return getattr(sample, name, default)


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch; ``index`` maps rows to positions in the step's batch (-1 = filler)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    trainer_logprobs: torch.Tensor | None
    index: list[int]
    ref_logprobs: torch.Tensor | None = None


def build_micro_batches(samples: Sequence[Any], *, indices: Sequence[int], micro_batch_size: int,
                        num_micro_batches: int, seq_len: int, advantages: torch.Tensor | None = None,
                        trainer_logprobs: Sequence[torch.Tensor] | None = None) -> list[MicroBatch]:
    """Pad ``samples[i] for i in indices`` into ``num_micro_batches`` micro-batches of ``seq_len``.

    Position ``t`` predicts token ``t+1``: ``targets[t] = ids[t+1]`` and ``loss_mask[t] = 1`` iff
    ``t+1`` is a response token; per-response-token tensors are aligned the same way."""
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    slots = list(indices) + [-1] * (num_micro_batches * micro_batch_size - len(indices))
    out = []
    for m in range(num_micro_batches):
        rows = slots[m * micro_batch_size:(m + 1) * micro_batch_size]
        tokens = torch.zeros(len(rows), seq_len, dtype=torch.long)
        targets = torch.zeros_like(tokens)
        lmask = torch.zeros(len(rows), seq_len)
        rlp = torch.zeros(len(rows), seq_len)
        tlp = torch.zeros(len(rows), seq_len)
        ref = torch.zeros(len(rows), seq_len)
        has_ref = False
        adv = torch.zeros(len(rows))
        for r, i in enumerate(rows):
            if i < 0:
                continue
            s = samples[i]
            prompt, response = list(_field(s, "prompt_ids")), list(_field(s, "response_ids"))
            ids = prompt + response
            if len(ids) > seq_len:
                raise ValueError(f"sample {i} has {len(ids)} tokens > seq_len {seq_len}")
            n, p = len(ids), len(prompt)
            tokens[r, :n] = torch.tensor(ids)
            targets[r, : n - 1] = torch.tensor(ids[1:])
            lmask[r, p - 1: n - 1] = 1.0
            lp = _field(s, "rollout_logprobs")
            if lp is not None and len(lp):
                rlp[r, p - 1: n - 1] = torch.as_tensor(lp, dtype=torch.float32)
            if trainer_logprobs is not None:
                tlp[r, p - 1: n - 1] = trainer_logprobs[i]
            ref_lp = _field(s, "ref_logprobs")
            if ref_lp is not None:
                ref[r, p - 1: n - 1] = torch.as_tensor(ref_lp, dtype=torch.float32)
                has_ref = True
            if advantages is not None:
                adv[r] = advantages[i]
        out.append(MicroBatch(
            tokens=tokens, position_ids=torch.arange(seq_len).unsqueeze(0).expand(len(rows), -1).contiguous(),
            attention_mask=mask, targets=targets, loss_mask=lmask, rollout_logprobs=rlp, advantages=adv,
            trainer_logprobs=tlp if trainer_logprobs is not None else None, index=rows,
            ref_logprobs=ref if has_ref else None))
    return out


class TrainerWorker:
    """One rank of the Megatron trainer (see the module docstring for the batch format).

    Construct on every rank of a torchrun job (or in a plain process for 1 rank; a local gloo group
    is created then). The CPU compatibility layer is activated for ``device == "cpu"`` and stays
    active until :meth:`close`.
    """

    def __init__(self, trainer_cfg: TrainerConfig, algo_cfg: AlgoConfig, hf_model_dir: str) -> None:
        from dora_megatron.trainer import cpu_compat, hf_io, model as model_mod, parallel

        self.cfg = trainer_cfg
        self.algo = algo_cfg
        self.hf_model_dir = hf_model_dir
        if trainer_cfg.num_threads:
            torch.set_num_threads(trainer_cfg.num_threads)
        self._compat = cpu_compat.activate(trainer_cfg.device)
        self.info = parallel.init_distributed(trainer_cfg)
        self.layout = self.info.layout
        self.arch = model_mod.load_arch(hf_model_dir)
        self.spec = model_mod.choose_spec(trainer_cfg.spec, trainer_cfg.device)
        self.config = model_mod.build_transformer_config(
            self.arch, tp=trainer_cfg.tp, pp=trainer_cfg.pp, ep=trainer_cfg.ep, device=trainer_cfg.device,
            moe_aux_loss_coef=trainer_cfg.moe_aux_loss_coef, spec=self.spec)
        self.config.calculate_per_token_loss = True
        torch.manual_seed(trainer_cfg.seed)
        gpt = model_mod.build_gpt_model(self.arch, self.config, self.spec, tp=trainer_cfg.tp,
                                        pre_process=self.layout.first_stage, post_process=self.layout.last_stage)
        if trainer_cfg.device == "cuda":
            gpt = gpt.cuda()
        hf_io.load_hf_into_model(gpt, hf_io.read_hf_safetensors(hf_model_dir), self.arch, self.layout)
        self.model = self._wrap_ddp(gpt)
        self.optimizer = self._build_optimizer()
        self.step = 0
        #: Rollout sampling temperature: engines report log_softmax(logits / T); set by the runtime.
        self.logit_temperature = 1.0
        logger.info("trainer rank %d: layout %s dp=%d spec=%s", self.info.rank, self.layout, self.info.dp, self.spec)

    # ------------------------------------------------------------------ setup

    def _wrap_ddp(self, gpt: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer, average_in_collective=False)
        model = DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=gpt)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = model.no_sync
        return model

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(
            optimizer="adam", lr=self.cfg.lr, min_lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
            adam_beta1=self.cfg.adam_beta1, adam_beta2=self.cfg.adam_beta2, adam_eps=self.cfg.adam_eps,
            clip_grad=self.cfg.grad_clip, use_distributed_optimizer=self.cfg.use_distributed_optimizer,
            params_dtype=torch.float32, bf16=False, fp16=False)
        return get_megatron_optimizer(ocfg, [self.model])

    def close(self) -> None:
        """Destroy process groups and deactivate the CPU layer (the worker is unusable afterwards)."""
        from dora_megatron.trainer import parallel

        parallel.destroy_distributed()
        self._compat.deactivate()

    # ------------------------------------------------------------------ batching

    def _seq_len(self, samples: Sequence[Any]) -> int:
        longest = max(len(_field(s, "prompt_ids")) + len(_field(s, "response_ids")) for s in samples)
        if longest > self.cfg.max_seq_len:
            raise ValueError(f"sample of {longest} tokens exceeds trainer.max_seq_len={self.cfg.max_seq_len}")
        mult = self.cfg.tp if self.config.sequence_parallel else 1
        return -(-longest // mult) * mult

    def _my_share(self, n: int) -> tuple[list[int], int]:
        """Indices of the samples this DP rank processes, and the (DP-uniform) micro-batch count."""
        dp, r = self.info.dp, self.info.dp_rank
        per = math.ceil(n / dp)
        idx = list(range(r * per, min(n, (r + 1) * per)))
        return idx, max(1, math.ceil(per / self.cfg.micro_batch_size))

    def _run(self, micro_batches: list[MicroBatch], seq_len: int, loss_fn, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            out = model(mb.tokens, mb.position_ids, mb.attention_mask)
            return out, lambda output: loss_fn(mb, output)

        dev = self.cfg.device
        if dev == "cuda":
            micro_batches = [_to_device(mb, "cuda") for mb in micro_batches]
        fwd_bwd = get_forward_backward_func()
        return fwd_bwd(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
                       num_microbatches=len(micro_batches), seq_length=seq_len,
                       micro_batch_size=self.cfg.micro_batch_size, forward_only=forward_only)

    def _logprobs(self, mb: MicroBatch, logits: torch.Tensor, with_entropy: bool):
        from dora_megatron.trainer.logprobs import token_logprobs_and_entropy

        if self.logit_temperature != 1.0:  # log-probs of the distribution the engine sampled from
            logits = logits / self.logit_temperature
        return token_logprobs_and_entropy(logits, mb.targets.to(logits.device), vocab_size=self.arch.vocab_size,
                                          tp=self.layout.tp, tp_rank=self.layout.tp_rank, with_entropy=with_entropy)

    # ------------------------------------------------------------------ verbs

    @torch.no_grad()
    def compute_logprobs(self, batch: Sequence[Any]) -> list[torch.Tensor]:
        """Per-response-token log-probs of every sample under the current weights (fp32, CPU).

        Collective; the full list (one ``[len(response_ids)]`` tensor per sample, in batch order) is
        returned on every rank."""
        seq_len = self._seq_len(batch)
        idx, nmb = self._my_share(len(batch))
        mbs = build_micro_batches(batch, indices=idx, micro_batch_size=self.cfg.micro_batch_size,
                                  num_micro_batches=nmb, seq_len=seq_len)
        results: dict[int, torch.Tensor] = {}

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            logp, _ = self._logprobs(mb, logits, with_entropy=False)
            for r, i in enumerate(mb.index):
                if i >= 0:
                    p = len(_field(batch[i], "prompt_ids"))
                    n = p + len(_field(batch[i], "response_ids"))
                    results[i] = logp[r, p - 1: n - 1].detach().float().cpu()
            zero = logits.sum() * 0
            return zero, torch.tensor(1, dtype=torch.int), {}

        self._run(mbs, seq_len, loss_fn, forward_only=True)
        from megatron.core import parallel_state as ps

        mine = results if (self.layout.last_stage and ps.get_tensor_model_parallel_rank() == 0) else {}
        gathered: list = [None] * self.info.world_size
        dist.all_gather_object(gathered, mine)
        merged: dict[int, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return [merged[i] for i in range(len(batch))]

    def advantages_for(self, batch: Sequence[Any]) -> torch.Tensor:
        """Given advantages, or estimator(rewards, group ids) from ``algo.advantage_estimator``."""
        from dora_megatron.algo.advantages import compute_advantages

        given = [_field(s, "advantage") for s in batch]
        if all(a is not None for a in given):
            return torch.tensor(given, dtype=torch.float32)
        rewards = torch.tensor([float(_field(s, "reward")) for s in batch])
        groups = [_field(s, "group_id") for s in batch]
        codes = {g: k for k, g in enumerate(dict.fromkeys(groups))}
        return compute_advantages(self.algo.advantage_estimator, rewards, [codes[g] for g in groups],
                                  eps=self.algo.adv_eps)

    def train_step(self, batch: Sequence[Any]) -> dict[str, float]:
        """One optimizer step on the whole ``batch`` (every rank passes the same batch).

        Returns the same metrics dict on every rank: ``loss``, ``pg_loss``, ``entropy``,
        ``clip_fraction``, ``grad_norm``, ``rollout_vs_trainer_logprob_diff`` (mean |trainer - rollout|
        log-prob per token, under the weights before the update), ``kl``/``tis_weight`` when enabled,
        ``num_tokens``, ``num_samples``, ``update_successful``, ``step``."""
        from dora_megatron.algo.losses import policy_loss, settings_from_config

        settings = settings_from_config(self.algo)
        advantages = self.advantages_for(batch)
        need_recompute = settings.tis_cap > 0
        trainer_lp = self.compute_logprobs(batch) if need_recompute else None
        seq_len = self._seq_len(batch)
        idx, nmb = self._my_share(len(batch))
        mbs = build_micro_batches(batch, indices=idx, micro_batch_size=self.cfg.micro_batch_size,
                                  num_micro_batches=nmb, seq_len=seq_len, advantages=advantages,
                                  trainer_logprobs=trainer_lp)
        has_rollout = all(_field(s, "rollout_logprobs") is not None for s in batch)
        if settings.kl_coef > 0 and any(_field(s, "ref_logprobs") is None for s in batch):
            raise ValueError("algo.kl_coef > 0 needs per-token 'ref_logprobs' on every sample (no reference model "
                             "is held by the trainer)")

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            logp, ent = self._logprobs(mb, logits, with_entropy=True)
            dev = logp.device
            rlp = mb.rollout_logprobs.to(dev)
            out = policy_loss(logp, rlp if has_rollout else logp.detach(), mb.advantages.to(dev),
                              mb.loss_mask.to(dev), settings,
                              rollout_logprobs=rlp if has_rollout else None,
                              trainer_logprobs=mb.trainer_logprobs.to(dev) if mb.trainer_logprobs is not None else None,
                              ref_logprobs=mb.ref_logprobs.to(dev) if mb.ref_logprobs is not None else None,
                              entropy=ent)
            report = {k: v.detach().reshape(()).float() for k, v in out.metric_sums.items()}
            report["loss_sum"] = out.loss_sum.detach().reshape(())
            report["denominator"] = torch.tensor(float(out.denominator))
            report["num_tokens"] = torch.tensor(float(out.num_tokens))
            report["num_samples"] = torch.tensor(float(sum(1 for i in mb.index if i >= 0)))
            return out.loss_sum, torch.tensor(out.denominator, dtype=torch.int), report

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run(mbs, seq_len, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        metrics = self._reduce_reports(reports)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_successful"] = float(bool(ok))
        metrics["step"] = float(self.step)
        return metrics

    def _reduce_reports(self, reports: list[dict]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        keys = ("loss_sum", "denominator", "num_tokens", "num_samples") + METRIC_KEYS
        present = torch.zeros(len(keys))
        totals = torch.zeros(len(keys), dtype=torch.float64)
        if self.layout.last_stage and ps.get_tensor_model_parallel_rank() == 0:
            for rep in reports:
                for k, name in enumerate(keys):
                    if name in rep:
                        totals[k] += float(rep[name])
                        present[k] = 1
        dev = torch.device("cuda", torch.cuda.current_device()) if self.cfg.device == "cuda" else torch.device("cpu")
        totals, present = totals.to(dev), present.to(dev)
        dist.all_reduce(totals)  # NCCL needs device tensors
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        t = dict(zip(keys, totals.tolist()))
        ntok = max(t["num_tokens"], 1.0)
        metrics = {"loss": t["loss_sum"] / max(t["denominator"], 1.0), "num_tokens": t["num_tokens"],
                   "num_samples": t["num_samples"]}
        for k, name in enumerate(keys):
            if name in METRIC_KEYS and present[k]:
                metrics[name] = t[name] / ntok
        return metrics

    def export_hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (per-expert layout, TP/EP/PP gathered), yielded on global rank 0 only.

        Collective: every rank must iterate it to the end (non-zero ranks get an empty iterator)."""
        from dora_megatron.trainer import hf_io

        return hf_io.export_hf(self.model, self.arch, self.layout)

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state_dict(self, is_loading: bool) -> dict:
        from dora_megatron.trainer.hf_io import unwrap

        model_sd = unwrap(self.model).sharded_state_dict()
        # dp_reshardable: parallel save/load without gathers; resharding only across DP. (fully_reshardable
        # breaks with the torch Adam fallback: it copies a per-param "step" the saved state lacks.)
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta),
                "step": self.step}

    def _unshare_adam_steps(self) -> None:
        """Megatron's DistributedOptimizer.load_state_dict (torch-Adam fallback) gives every parameter
        the *same* ``step`` tensor; torch Adam increments each param's step in place, so a shared
        tensor would advance N times per step and break bias correction. Give each its own copy."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in chained:
            inner = getattr(opt, "optimizer", None)
            for st in getattr(inner, "state", {}).values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()

    def _init_optimizer_state(self) -> None:
        """Materialise Adam state with a zero-gradient step (torch Adam creates state lazily and
        Megatron's state_dict needs it before a load). Parameters are overwritten by the load."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.optimizer.step()

    @torch.no_grad()
    def save_checkpoint(self, directory: str) -> None:
        """Collective ``dist_checkpointing`` save of model + optimizer state + step into ``directory``."""
        from megatron.core import dist_checkpointing

        try:
            import psutil  # noqa: F401  (megatron's torch_dist writer needs it but does not declare it)
        except ImportError as exc:
            raise RuntimeError("dist_checkpointing save needs the 'psutil' package: pip install psutil") from exc
        if self.info.rank == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), directory)
        dist.barrier()

    @torch.no_grad()
    def load_checkpoint(self, directory: str) -> None:
        """Collective load of a :meth:`save_checkpoint` directory (same or another layout)."""
        from megatron.core import dist_checkpointing

        if self.step == 0:
            self._init_optimizer_state()
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), directory)
        from dora_megatron.trainer.hf_io import unwrap

        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._unshare_adam_steps()
        self.step = int(state["step"])
        dist.barrier()


def _to_device(mb: MicroBatch, device: str) -> MicroBatch:
    return MicroBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in mb.__dict__.items()})
