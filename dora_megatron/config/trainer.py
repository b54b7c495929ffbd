"""Trainer section: Megatron parallel layout, optimizer and checkpoint settings.

WHY a separate section: the trainer runs in its own torchrun ranks; everything they need to build
the same model layout, optimizer and checkpoints deterministically is here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dora_megatron.config.base import ConfigError, field_doc


@dataclass
class TrainerConfig:
    """Megatron-Core trainer settings (parallel sizes, optimizer, device).

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
    pp: int = field_doc(1, "pipeline-parallel size (layers are split evenly)", ge=1)
    ep: int = field_doc(1, "expert-parallel size (MoE models only; experts split evenly)", ge=1)
    dp: int = field_doc(0, "data-parallel size; 0 = derived as world_size / (tp * pp)", ge=0)
    micro_batch_size: int = field_doc(1, "samples per micro-batch, all padded to the step's longest sample "
                                         "(used when max_tokens_per_micro_batch is 0)", ge=1)
    max_tokens_per_micro_batch: int = field_doc(
        0, "token budget of a micro-batch: samples sorted by length, each micro-batch holds as many as fit "
           "at the padded length of its longest (rows x length <= budget), which removes most padding with "
           "long-tailed lengths; 0 = fixed micro_batch_size rows padded to the step's longest sample. "
           "Must be >= max_seq_len (the longest sample fits); with pp > 1 it needs a dense model or the "
           "alltoall MoE dispatcher (CUDA)", ge=0)
    max_seq_len: int = field_doc(4096, "longest prompt+response the trainer accepts, tokens", ge=1)
    lr: float = field_doc(1e-6, "Adam learning rate (constant)", gt=0)
    weight_decay: float = field_doc(0.0, "decoupled weight decay", ge=0)
    grad_clip: float = field_doc(1.0, "max global grad norm; 0 disables clipping", ge=0)
    adam_beta1: float = field_doc(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = field_doc(0.999, "Adam beta2", ge=0, lt=1)
    adam_eps: float = field_doc(1e-8, "Adam epsilon", gt=0)
    use_distributed_optimizer: bool = field_doc(True, "shard optimizer state over data-parallel ranks")
    seed: int = field_doc(1234, "seed for parameter init and any sampling in the trainer")
    device: str = field_doc("cpu", "where the trainer runs", choices=("cpu", "cuda"))
    num_threads: int = field_doc(0, "torch intra-op threads per rank on CPU; 0 = torch default", ge=0)
    moe_aux_loss_coef: float = field_doc(0.0, "MoE load-balancing aux-loss coefficient", ge=0)
    spec: str = field_doc("auto", "layer spec: auto (TE if importable and cuda), te, local",
                          choices=("auto", "te", "local"))

    def check(self, path: str) -> None:
        if self.device == "cpu" and self.spec == "te":
            raise ConfigError(f"{path}.spec", "the Transformer Engine spec needs device cuda")
        if 0 < self.max_tokens_per_micro_batch < self.max_seq_len:
            raise ConfigError(f"{path}.max_tokens_per_micro_batch",
                              f"{self.max_tokens_per_micro_batch} is below max_seq_len={self.max_seq_len}: a micro-batch "
                              "must hold the longest sample the trainer accepts (or set 0 to disable token budgets)")

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises ConfigError when the layout does not fit."""
        model = self.tp * self.pp
        if world_size % model:
            raise ConfigError("trainer", f"world size {world_size} not divisible by tp*pp={model}")
        dp = world_size // model
        if self.dp and self.dp != dp:
            raise ConfigError("trainer.dp", f"dp={self.dp} but world/(tp*pp)={dp}")
        if (world_size // self.pp) % (self.ep * self.tp):
            raise ConfigError("trainer.ep", f"world/pp={world_size // self.pp} not divisible by ep*tp")
        return dp
