"""Trainer section: Megatron parallel layout, precision, recompute, optimizer and schedule.

WHY a separate section: the trainer runs in its own torchrun ranks; everything they need to build
the same model layout, optimizer and checkpoints deterministically is here and nowhere else.

WHY typed keys *and* ``megatron:``: the knobs a production MoE run turns (precision, recompute,
SP/CP/ETP/VPP, dispatcher, schedule) are typed keys whose combinations are checked here, before
anything starts; every other field of Megatron-Core's ``TransformerConfig``, ``OptimizerConfig`` and
``DistributedDataParallelConfig`` is one line of ``trainer.megatron`` (its names are checked against
those dataclasses by :mod:`dora_megatron.trainer.megatron_args` when the job starts, since this
package never imports Megatron). A Megatron field that a typed key (or the model's ``config.json``)
already sets is refused in ``trainer.megatron``: one knob, one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_megatron.config.base import ConfigError, field_doc

#: Megatron config fields a typed key of this section sets (refused in ``trainer.megatron``).
TYPED_MEGATRON_FIELDS: dict[str, str] = {
    **dict.fromkeys(("tensor_model_parallel_size",), "tp"),
    **dict.fromkeys(("pipeline_model_parallel_size",), "pp"),
    **dict.fromkeys(("expert_model_parallel_size",), "ep"),
    **dict.fromkeys(("context_parallel_size",), "cp"),
    **dict.fromkeys(("expert_tensor_parallel_size",), "etp"),
    **dict.fromkeys(("virtual_pipeline_model_parallel_size",), "vpp"),
    **dict.fromkeys(("sequence_parallel",), "sequence_parallel"),
    **dict.fromkeys(("bf16", "fp16", "params_dtype", "pipeline_dtype", "main_params_dtype", "main_grads_dtype",
                     "grad_reduce_in_fp32", "use_precision_aware_optimizer"), "precision"),
    **dict.fromkeys(("recompute_granularity",), "recompute"),
    **dict.fromkeys(("recompute_method",), "recompute_method"),
    **dict.fromkeys(("recompute_num_layers",), "recompute_num_layers"),
    **dict.fromkeys(("moe_token_dispatcher_type",), "moe_token_dispatcher"),
    **dict.fromkeys(("moe_grouped_gemm",), "moe_grouped_gemm"),
    **dict.fromkeys(("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
                     "apply_rope_fusion", "gradient_accumulation_fusion", "moe_permute_fusion"), "fusions"),
    **dict.fromkeys(("lr",), "lr"),
    **dict.fromkeys(("min_lr",), "min_lr"),
    **dict.fromkeys(("weight_decay",), "weight_decay"),
    **dict.fromkeys(("clip_grad",), "grad_clip"),
    **dict.fromkeys(("adam_beta1",), "adam_beta1"),
    **dict.fromkeys(("adam_beta2",), "adam_beta2"),
    **dict.fromkeys(("adam_eps",), "adam_eps"),
    **dict.fromkeys(("use_distributed_optimizer",), "use_distributed_optimizer"),
    **dict.fromkeys(("optimizer_cpu_offload",), "optimizer_cpu_offload"),
    **dict.fromkeys(("overlap_grad_reduce",), "overlap_grad_reduce"),
    **dict.fromkeys(("overlap_param_gather",), "overlap_param_gather"),
    **dict.fromkeys(("moe_aux_loss_coeff", "moe_router_load_balancing_type"), "moe_aux_loss_coef"),
}

#: Megatron fields dora itself derives (from the model's config.json or because the trainer depends on
#: them): {field: why it cannot be overridden}.
DERIVED_MEGATRON_FIELDS: dict[str, str] = {
    **dict.fromkeys((
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_router_score_function", "moe_router_pre_softmax"),
        "read from the model's config.json (the trainer must compute the function the rollout engines serve)"),
    **dict.fromkeys(("hidden_dropout", "attention_dropout"),
                    "0: the trainer's log-probs must equal the engines' (dropout would make them differ)"),
    "calculate_per_token_loss": "the loss is normalised over the whole global batch by the trainer itself",
    "variable_seq_lengths": "set from trainer.max_tokens_per_micro_batch and pp",
    "moe_enable_routing_replay": "the trainer's router-agreement metric and algo.routing_replay need it",
    "use_cpu_initialization": "set from trainer.device",
    "deterministic_mode": "set from trainer.device (on for cpu)",
    "transformer_impl": "set from trainer.spec",
    "moe_router_dtype": "fp32, as the engines route",
    "average_in_collective": "the per-token loss normalisation needs plain sums",
}


@dataclass
class TrainerConfig:
    """Megatron-Core trainer settings (parallel sizes, precision, recompute, optimizer, device).

    Checkpoints are the run's (``run.checkpoint_interval``, under ``RUN_DIR/checkpoints/``): the
    trainer and the controller state must be saved at the same step boundary, so the trainer has
    no checkpoint keys of its own."""

    # keys that existed once and were never read: {key: (old default, what to set instead)}; a config
    # that sets one to anything but its old default is refused with that message (loader.from_dict)
    REMOVED_KEYS: ClassVar[dict[str, tuple[Any, str]]] = {
        "checkpoint_dir": ("", "checkpoints are always written to RUN_DIR/checkpoints/vNNNNNN (trainer and "
                               "controller state together); delete the key and set run.checkpoint_interval"),
        "checkpoint_interval": (0, "use run.checkpoint_interval (it saves the trainer and the controller state "
                                   "together)"),
    }

    tp: int = field_doc(1, "tensor-parallel size", ge=1)
    pp: int = field_doc(1, "pipeline-parallel size (layers are split evenly unless trainer.megatron.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage / pipeline_model_parallel_layout say otherwise)", ge=1)
    ep: int = field_doc(1, "expert-parallel size (MoE models only; experts split evenly)", ge=1)
    dp: int = field_doc(0, "data-parallel size; 0 = derived as world_size / (tp * pp * cp)", ge=0)
    cp: int = field_doc(1, "context-parallel size: each sequence is split into 2*cp chunks over cp ranks (needs the "
                           "Transformer Engine spec, i.e. cuda; max_seq_len must be divisible by 2*cp; "
                           "algo.length_norm token_mean, no routing replay)", ge=1)
    etp: int = field_doc(0, "expert tensor-parallel size (MoE experts are split over etp ranks instead of tp); "
                            "0 = tp (Megatron's default). etp * ep must divide world_size / pp", ge=0)
    vpp: int = field_doc(1, "virtual pipeline stages per pipeline rank (interleaved 1F1B schedule); needs pp > 1 and "
                            "the model's layers divisible by pp * vpp (by Megatron's rules under an uneven split)", ge=1)
    sequence_parallel: bool = field_doc(False, "Megatron sequence parallelism (activations outside the TP regions are "
                                               "split over the TP ranks); needs tp > 1. Always on for a MoE model "
                                               "with tp > 1 (Megatron requires it there)")
    micro_batch_size: int = field_doc(1, "samples per micro-batch, all padded to the step's longest sample "
                                         "(used when max_tokens_per_micro_batch is 0)", ge=1)
    max_tokens_per_micro_batch: int = field_doc(
        0, "token budget of a micro-batch: samples sorted by length, each micro-batch holds as many as fit "
           "at the padded length of its longest (rows x length <= budget), which removes most padding with "
           "long-tailed lengths; 0 = fixed micro_batch_size rows padded to the step's longest sample. "
           "Must be >= max_seq_len (the longest sample fits); with pp > 1 it needs a dense model or the "
           "alltoall MoE dispatcher", ge=0)
    max_seq_len: int = field_doc(4096, "longest prompt+response the trainer accepts, tokens", ge=1)
    precision: str = field_doc("fp32", "parameters and compute: fp32; bf16 (bf16 parameters and activations, fp32 "
                                       "main parameters, gradients and Adam state in Megatron's mixed-precision "
                                       "optimizer); fp16 (as bf16 with a dynamic loss scale). The log-prob "
                                       "recompute runs in the same precision", choices=("fp32", "bf16", "fp16"))
    recompute: str = field_doc("none", "activation recompute: none; selective (Megatron's recompute_modules, by "
                                       "default core attention: the s x s scores are recomputed in backward); full "
                                       "(each layer keeps only its input, see recompute_method)",
                               choices=("none", "selective", "full"))
    recompute_method: str = field_doc("uniform", "full recompute only: uniform (the layers of a stage are split into "
                                                 "chunks of recompute_num_layers, each recomputed as a whole) or "
                                                 "block (only the first recompute_num_layers layers of each stage "
                                                 "are recomputed)", choices=("uniform", "block"))
    recompute_num_layers: int = field_doc(1, "full recompute only: layers per recomputed chunk (uniform) or "
                                             "recomputed layers per stage (block)", ge=1)
    moe_token_dispatcher: str = field_doc("auto", "MoE token dispatcher: allgather, alltoall, flex (DeepEP kernels, or "
                                                  "HybridEP with megatron.moe_flex_dispatcher_backend: hybridep; cuda "
                                                  "only); auto = allgather on cpu, alltoall on cuda",
                                          choices=("auto", "allgather", "alltoall", "flex"))
    moe_grouped_gemm: bool = field_doc(False, "run a rank's local experts as one grouped GEMM (Transformer Engine "
                                              "spec: TEGroupedMLP; cuda only)")
    fusions: bool | None = field_doc(None, "Megatron's fused kernels (bias-activation, bias-dropout, RoPE, masked "
                                           "softmax, persistent layer norm, gradient-accumulation, MoE permute): "
                                           "null = on with the Transformer Engine spec, off otherwise; true needs the "
                                           "TE spec")
    lr: float = field_doc(1e-6, "peak Adam learning rate (after warmup)", gt=0)
    lr_warmup_steps: int = field_doc(0, "optimizer steps of linear warmup from 0 to lr (Megatron's "
                                        "OptimizerParamScheduler); update k of the run uses lr * k / warmup", ge=0)
    lr_decay: str = field_doc("constant", "learning-rate decay after warmup, to min_lr at lr_decay_steps: constant, "
                                          "linear, cosine", choices=("constant", "linear", "cosine"))
    lr_decay_steps: int = field_doc(0, "optimizer step at which the decay reaches min_lr; 0 = run.steps", ge=0)
    min_lr: float = field_doc(0.0, "learning rate at the end of the decay (linear / cosine only)", ge=0)
    override_opt_param_scheduler: bool = field_doc(
        False, "on resume, continue with this run's LR schedule (lr, min_lr, lr_warmup_steps, lr_decay, "
               "lr_decay_steps or run.steps, weight_decay) from the checkpoint's step, where a checkpoint written "
               "with other settings is otherwise refused (Megatron's override_opt_param_scheduler; e.g. a "
               "decaying schedule extended by a larger run.steps)")
    use_checkpoint_opt_param_scheduler: bool = field_doc(
        False, "on resume, continue with the checkpoint's LR schedule whatever this run's schedule keys say "
               "(Megatron's use_checkpoint_opt_param_scheduler); excludes override_opt_param_scheduler")
    weight_decay: float = field_doc(0.0, "decoupled weight decay; norms and biases are skipped (Megatron's rule: "
                                         "1-D parameters and *.bias)", ge=0)
    grad_clip: float = field_doc(1.0, "max global grad norm; 0 disables clipping", ge=0)
    adam_beta1: float = field_doc(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = field_doc(0.999, "Adam beta2", ge=0, lt=1)
    adam_eps: float = field_doc(1e-8, "Adam epsilon", gt=0)
    use_distributed_optimizer: bool = field_doc(True, "shard optimizer state (and fp32 main parameters) over "
                                                      "data-parallel ranks")
    optimizer_cpu_offload: bool = field_doc(False, "keep the optimizer state in host memory and step it on the CPU "
                                                   "(Megatron's HybridDeviceOptimizer; cuda with the distributed "
                                                   "optimizer only)")
    overlap_grad_reduce: bool = field_doc(False, "overlap the data-parallel gradient reduction with the backward pass "
                                                 "(Megatron DDP's bucketed asynchronous reduction; also over gloo)")
    overlap_param_gather: bool = field_doc(False, "refused: Megatron defers the distributed optimizer's parameter "
                                                  "all-gather into the next forward, but the trainer exports the "
                                                  "weights right after each step")
    seed: int = field_doc(1234, "seed for parameter init and any sampling in the trainer")
    device: str = field_doc("cpu", "where the trainer runs", choices=("cpu", "cuda"))
    num_threads: int = field_doc(0, "torch intra-op threads per rank on CPU; 0 = torch default", ge=0)
    moe_aux_loss_coef: float = field_doc(0.0, "MoE load-balancing aux-loss coefficient", ge=0)
    spec: str = field_doc("auto", "layer spec: auto (TE if importable, on cuda and the TE spec builds the model, "
                                  "else local: MLA and dense layers inside an MoE are local only), te, local",
                          choices=("auto", "te", "local"))
    peak_tflops: float = field_doc(0.0, "dense peak TFLOP/s of one GPU at trainer.precision, for perf/trainer_mfu; "
                                        "0 = looked up from the CUDA device name (A100, H100, H200, B200; no MFU "
                                        "when unknown)", ge=0)
    megatron: dict[str, Any] = field_doc(
        default_factory=dict, doc="any other field of Megatron-Core's TransformerConfig, OptimizerConfig or "
                                  "DistributedDataParallelConfig, {field: value}, applied to every class that has "
                                  "it (e.g. `recompute_modules: [core_attn, moe_act]`, `moe_router_fusion: true`, an uneven "
                                  "pipeline split: `num_layers_in_first_pipeline_stage: 13`); "
                                  "names are checked against those dataclasses before the job starts, and a field "
                                  "a typed key of this section sets is refused here")

    def check(self, path: str) -> None:
        if self.device == "cpu" and self.spec == "te":
            raise ConfigError(f"{path}.spec", "the Transformer Engine spec needs device cuda")
        if 0 < self.max_tokens_per_micro_batch < self.max_seq_len:
            raise ConfigError(f"{path}.max_tokens_per_micro_batch",
                              f"{self.max_tokens_per_micro_batch} is below max_seq_len={self.max_seq_len}: a micro-batch "
                              "must hold the longest sample the trainer accepts (or set 0 to disable token budgets)")
        self._check_parallel(path)
        self._check_recompute(path)
        self._check_optimizer(path)
        self._check_megatron(path)

    def _check_parallel(self, path: str) -> None:
        cpu = self.device == "cpu"
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(f"{path}.sequence_parallel", "needs tp > 1 (it splits activations over the TP ranks)")
        if self.cp > 1:
            if cpu:
                raise ConfigError(f"{path}.cp", "context parallelism needs Transformer Engine's attention "
                                                "(TEDotProductAttention, cuda); Megatron's local attention used on "
                                                "cpu refuses cp > 1")
            if self.max_seq_len % (2 * self.cp):
                raise ConfigError(f"{path}.cp", f"max_seq_len={self.max_seq_len} cannot be split into 2*cp={2 * self.cp} "
                                                "equal chunks (Megatron's load-balanced context parallelism): make "
                                                "max_seq_len a multiple of 2*cp")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"{path}.vpp", "the interleaved schedule needs pp > 1")
        if self.moe_token_dispatcher == "flex" and cpu:
            raise ConfigError(f"{path}.moe_token_dispatcher", "flex needs the DeepEP or HybridEP CUDA kernels: "
                                                              "use allgather or alltoall on cpu")
        if self.moe_grouped_gemm and cpu:
            raise ConfigError(f"{path}.moe_grouped_gemm", "grouped GEMM runs in Transformer Engine's (or the "
                                                          "grouped_gemm package's) CUDA kernels: set false on cpu")
        if self.fusions and (cpu or self.spec == "local"):
            raise ConfigError(f"{path}.fusions", "the fused kernels need the Transformer Engine spec (device cuda, "
                                                 "spec auto or te): set null or false")

    def _check_recompute(self, path: str) -> None:
        if self.recompute != "full":
            if self.recompute_method != "uniform":
                raise ConfigError(f"{path}.recompute_method", f"only applies to recompute: full (recompute is "
                                                              f"{self.recompute})")
            if self.recompute_num_layers != 1:
                raise ConfigError(f"{path}.recompute_num_layers", f"only applies to recompute: full (recompute is "
                                                                  f"{self.recompute})")

    def _check_optimizer(self, path: str) -> None:
        cpu = self.device == "cpu"
        if self.min_lr > self.lr:
            raise ConfigError(f"{path}.min_lr", f"{self.min_lr} is above lr={self.lr}")
        if self.lr_decay == "constant" and self.min_lr:
            raise ConfigError(f"{path}.min_lr", "has no effect with lr_decay: constant (set linear or cosine, or 0)")
        if self.lr_decay == "constant" and self.lr_decay_steps:
            raise ConfigError(f"{path}.lr_decay_steps", "has no effect with lr_decay: constant")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(f"{path}.override_opt_param_scheduler", "excludes use_checkpoint_opt_param_scheduler "
                                                                      "(a resume takes either this run's schedule "
                                                                      "or the checkpoint's): set one of them")
        if self.lr_decay_steps and self.lr_warmup_steps >= self.lr_decay_steps:
            raise ConfigError(f"{path}.lr_warmup_steps", f"{self.lr_warmup_steps} must be below lr_decay_steps="
                                                         f"{self.lr_decay_steps}")
        if self.optimizer_cpu_offload:
            if cpu:
                raise ConfigError(f"{path}.optimizer_cpu_offload", "offloads GPU optimizer state to the host: the "
                                                                   "trainer already runs on cpu")
            if not self.use_distributed_optimizer:
                raise ConfigError(f"{path}.optimizer_cpu_offload", "Megatron offloads the distributed optimizer "
                                                                   "only: set use_distributed_optimizer: true")
        if self.overlap_param_gather:
            raise ConfigError(f"{path}.overlap_param_gather", "the trainer exports the new weights right after every "
                                                              "optimizer step (snapshot or broadcast to rollout), so "
                                                              "the parameter all-gather cannot be deferred into the "
                                                              "next forward pass: leave it false")

    def _check_megatron(self, path: str) -> None:
        for name in self.megatron:
            if name in TYPED_MEGATRON_FIELDS:
                raise ConfigError(f"{path}.megatron.{name}", f"set through {path}.{TYPED_MEGATRON_FIELDS[name]} (one "
                                                             "knob, one place): remove it from trainer.megatron")
            if name in DERIVED_MEGATRON_FIELDS:
                raise ConfigError(f"{path}.megatron.{name}", f"cannot be overridden: {DERIVED_MEGATRON_FIELDS[name]}")

    # ------------------------------------------------------------------ derived sizes

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, 0 = ``tp``)."""
        return self.etp or self.tp

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises ConfigError when the layout does not fit."""
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ConfigError("trainer", f"world size {world_size} not divisible by tp*pp*cp={model}")
        dp = world_size // model
        if self.dp and self.dp != dp:
            raise ConfigError("trainer.dp", f"dp={self.dp} but world/(tp*pp*cp)={dp}")
        if (world_size // self.pp) % (self.ep * self.expert_tp):
            key = "trainer.etp" if self.etp else "trainer.ep"
            raise ConfigError(key, f"world/pp={world_size // self.pp} not divisible by ep*etp={self.ep * self.expert_tp} "
                                   "(the experts' ranks must tile the world)")
        return dp
