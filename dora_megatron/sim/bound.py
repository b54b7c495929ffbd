"""The physical throughput bound of a configured deployment, from the simulator's own cost model.

WHY: a speed-up over sync says how much better a schedule is than another schedule, not how much
is left. This module answers the second question: what the deployment could sustain if no
request ever waited for the tail, no slot were ever empty and no trainer ever idled for a
reason other than a missing capacity. Each mode's simulated throughput divided by this bound is
its *efficiency*; a mode at ~1.0 can only be made faster by another deployment (trainer/rollout
split, instance size, KV tier, elastic colocation), not by another schedule.

Definitions (all tokens are prompt + response of consumed samples, like ``throughput_tokens_per_s``):

- *Instance rollout capacity*: a steady-state instance at full physical concurrency ``n`` (the
  ``n <= max_concurrent`` with the best rate whose mean resident context fits device KV plus the
  host tier) decodes one token per running request per step of ``DecodeCost.step_s(n, n*C)``,
  ``C`` the time-averaged resident context of the workload (``E[L*P + L*(L-1)/2] / E[L]`` over
  the length distribution), and pays the prefill of every admitted request:
  ``E[P + L] / (E[L] * step / n + E[prefill(P)])``. Orchestrator caps are policy, not physics:
  they are not applied, so a cap below the physical one shows up as lost efficiency.
- *Training capacity*: ``tokens_per_step / (train_s(tokens_per_step, trainer accelerators) +
  per-step trainer sync)``, ``tokens_per_step = TBS x G x E[P + L]``.
- *Capacity bound* of a disaggregated mode: ``min(rollout, training)``; of a colocated mode (every
  accelerator alternates): ``tokens / (tokens / rollout + train_s + 2 x colocated_switch_s)``;
  with elastic colocation, the step time ``tau`` is the smallest that gives the rollout work
  ``W = tokens / instance capacity`` enough instance-seconds: the rollout pool's ``N x tau`` plus
  the elastic instances' ``(tau - trainer busy - their weight load)``, never below the trainer's
  busy time.

- *Tail bound*: version ``w`` exists from the end of step ``w-1`` and its groups must be consumed
  by step ``w+S`` (no group is lost, C3 holds), so the slowest sample of a batch, prefilled and
  decoded alone (``tail_s``: the smallest over consecutive TBS-group batches of the stream), must
  fit in ``S`` step times (disaggregated; ``S = 0``: the trainer waits for it) or in ``S + 1``
  rollout phases (colocated). This is what the long tail costs whatever the capacities: a
  deployment whose *bound* (``min(capacity bound, tail bound)``) is the tail is made faster by a
  larger ``S`` or a faster single-request decode, not by more accelerators.

With speculative decoding on (``rollout.speculative``), both the instance capacity and the tail
use the decode cost the engine's policy gives their batch (verify steps of the draft length it
chooses at batch 1 and at each concurrency where a draft pays, none above
``rollout.spec_max_batch``), so the bound moves with speculation.

Weight switches of rollout instances and re-prefill (partial mode) are left out, so the bound
stays an upper bound of what the cost model allows for the workload's mean batch (a short run on
few groups per batch can consume heavier batches than the mean); length drift is evaluated at
version 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dora_megatron.config.sim import CostModelConfig, SimConfig
from dora_megatron.sim.cost import DecodeModel, kv_admit_tokens, prefill_s
from dora_megatron.sim.workload import Workload

#: groups drawn to estimate the length moments (the same deterministic stream the simulation uses)
MOMENT_GROUPS = 4096


@dataclass(frozen=True)
class LengthMoments:
    """Per-sample means of the workload that fix an instance's steady state."""

    prompt_tokens: float  # E[P]
    response_tokens: float  # E[L]
    resident_context: float  # E[L*P + L*(L-1)/2] / E[L]: time-averaged context of a running request
    prefill_s: float  # E[prefill(P)]
    tail_s: float = 0.0  # min over consecutive TBS-group batches of the batch's slowest sample, decoded alone

    @property
    def sample_tokens(self) -> float:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True)
class InstanceCapacity:
    concurrency: int
    step_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class DeploymentBound:
    """What ``dora simulate`` reports as ``bound`` (tokens/s unless stated)."""

    placement: str
    rollout_instances: int
    elastic_instances: int
    trainer_gpus: int
    max_staleness: int
    tokens_per_step: float
    instance_concurrency: int
    instance_step_s: float
    rollout_tokens_per_s: float  # the rollout pool alone (elastic instances not counted)
    training_tokens_per_s: float  # the trainer alone, its per-step sync included
    capacity_bound_tokens_per_s: float  # min(rollout, training); time-shared when colocated; elastic
    tail_s: float  # slowest sample of a batch, decoded alone (mean over batches)
    tail_bound_tokens_per_s: float  # what the staleness window allows that tail
    bound_tokens_per_s: float  # min(capacity bound, tail bound)
    binding: str  # "rollout" | "training" | "time-shared" (colocated capacity) | "tail"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def length_moments(cfg: SimConfig, groups: int = MOMENT_GROUPS) -> LengthMoments:
    """Means over the first ``max(groups, TBS)`` groups of the workload stream (version 0)."""
    ocfg = cfg.orchestrator_config()
    wl = Workload(cfg.workload, ocfg.group_size)
    decode = DecodeModel.from_config(cfg.cost, cfg.rollout).for_batch(1)  # alone: speculating where the policy does
    n = sp = sl = sres = spf = 0.0
    batch_tails: list[float] = []
    groups = max(groups, ocfg.tbs)
    for k in range(groups - groups % ocfg.tbs):
        g = wl.group(k, 0)
        pf = prefill_s(cfg.cost, g.prompt_tokens)
        if k % ocfg.tbs == 0:
            batch_tails.append(0.0)
        # the fastest a sample can finish: prefilled and decoded alone on an instance
        batch_tails[-1] = max(batch_tails[-1], pf + decode.span_s(1, g.prompt_tokens, max(g.response_tokens)))
        for L in g.response_tokens:
            n += 1
            sp += g.prompt_tokens
            sl += L
            sres += L * g.prompt_tokens + L * (L - 1) / 2.0
            spf += pf
    return LengthMoments(sp / n, sl / n, sres / sl, spf / n, min(batch_tails))


def instance_capacity(cost: CostModelConfig, m: LengthMoments, model: DecodeModel | None = None) -> InstanceCapacity:
    """Best steady-state rate of one instance over the physically admissible concurrencies (each
    at the decode cost the speculation policy gives that batch)."""
    model = model or DecodeModel.from_config(cost)
    fit = max(1, math.floor(kv_admit_tokens(cost) / max(1.0, m.resident_context)))
    best = InstanceCapacity(1, 0.0, 0.0)
    for n in range(1, min(cost.max_concurrent, fit) + 1):
        step = model.for_batch(n).step_s(n, n * m.resident_context)
        rate = m.sample_tokens / (m.response_tokens * step / n + m.prefill_s)
        if rate > best.tokens_per_s:
            best = InstanceCapacity(n, step, rate)
    return best


def deployment_bound(cfg: SimConfig, moments: LengthMoments | None = None) -> DeploymentBound:
    """The bound of ``cfg``'s mode on ``cfg``'s cluster (see the module docstring)."""
    m = moments or length_moments(cfg)
    ocfg = cfg.orchestrator_config()
    mode, cost, cl, S = ocfg.mode, cfg.cost, cfg.cluster, ocfg.effective_staleness
    inst = instance_capacity(cost, m, DecodeModel.from_config(cost, cfg.rollout))
    tokens = ocfg.tbs * ocfg.group_size * m.sample_tokens
    n_roll = cl.rollout_instances(mode)
    n_el = cl.elastic_instances(mode)
    gpus = cl.trainer_gpu_count(mode)
    rollout = n_roll * inst.tokens_per_s
    train_s = cost.train_s(int(tokens), gpus)
    if cl.placement(mode) == "colocated":
        busy = train_s + 2 * cost.colocated_switch_s
        step, binding = tokens / rollout + busy, "time-shared"
        # a group dispatched in the rollout phase of step w is consumed by step w+S at the
        # latest: its slowest sample has S+1 rollout phases
        tail_step = busy + m.tail_s / (S + 1)
    else:
        busy = train_s + cost.trainer_push_s
        tau_roll = tokens / rollout
        step, floor = max(busy, tau_roll), busy
        if n_el and tau_roll > busy:
            # elastic instances serve between steps: they leave for training (the trainer pays one
            # role swap) and load the new weights when they come back (one more)
            busy_el = busy + cost.colocated_switch_s
            work = tokens / inst.tokens_per_s  # instance-seconds of rollout per step
            tau_el = (work + n_el * (busy_el + cost.colocated_switch_s)) / (n_roll + n_el)
            if tau_el >= busy_el + cost.colocated_switch_s and max(busy_el, tau_el) < step:
                step, floor = max(busy_el, tau_el), busy_el
        binding = "training" if step <= floor * (1 + 1e-9) else "rollout"
        # version w exists from the end of step w-1 and its groups must be consumed by step w+S,
        # which starts S steps later (S = 0: the trainer waits for the whole rollout)
        tail_step = m.tail_s / S if S > 0 else busy + m.tail_s
    capacity, tail = tokens / step, tokens / tail_step
    if tail < capacity:
        binding = "tail"
    return DeploymentBound(cl.placement(mode), n_roll, n_el, gpus, S, tokens, inst.concurrency, inst.step_s,
                           rollout, tokens / busy, capacity, m.tail_s, tail, min(capacity, tail), binding)


def bound_report(cfg: SimConfig, throughput: float | None, moments: LengthMoments | None = None) -> dict[str, Any]:
    """The ``bound`` block of a ``dora simulate`` result, with ``efficiency`` = throughput / bound."""
    b = deployment_bound(cfg, moments)
    out = b.to_json()
    out["efficiency"] = (throughput / b.bound_tokens_per_s) if throughput and b.bound_tokens_per_s > 0 else None
    return out
