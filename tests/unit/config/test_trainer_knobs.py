"""The trainer's production knobs: every impossible combination is refused at config load, naming
the key and the reason (pure config: no Megatron import)."""

from __future__ import annotations

import pytest

from dora_megatron.config.base import ConfigError
from dora_megatron.config.schema import load_config

CUDA = ["trainer.device=cuda", "rollout.device=cuda"]


@pytest.mark.parametrize("overrides,key,reason", [
    (["trainer.sequence_parallel=true"], "trainer.sequence_parallel", "needs tp > 1"),
    (["trainer.cp=2"], "trainer.cp", "TEDotProductAttention"),
    ([*CUDA, "trainer.cp=3", "trainer.max_seq_len=100", "launch.trainer_procs=3"], "trainer.cp", "2*cp=6"),
    (["trainer.vpp=2"], "trainer.vpp", "pp > 1"),
    (["trainer.moe_token_dispatcher=flex"], "trainer.moe_token_dispatcher", "DeepEP"),
    (["trainer.moe_grouped_gemm=true"], "trainer.moe_grouped_gemm", "CUDA kernels"),
    (["trainer.fusions=true"], "trainer.fusions", "Transformer Engine spec"),
    ([*CUDA, "trainer.spec=local", "trainer.fusions=true"], "trainer.fusions", "Transformer Engine spec"),
    (["trainer.recompute=selective", "trainer.recompute_method=block"], "trainer.recompute_method", "full"),
    (["trainer.recompute_num_layers=2"], "trainer.recompute_num_layers", "full"),
    (["trainer.optimizer_cpu_offload=true"], "trainer.optimizer_cpu_offload", "already runs on cpu"),
    ([*CUDA, "trainer.optimizer_cpu_offload=true", "trainer.use_distributed_optimizer=false"],
     "trainer.optimizer_cpu_offload", "distributed optimizer"),
    (["trainer.overlap_param_gather=true"], "trainer.overlap_param_gather", "exports the new weights"),
    (["trainer.min_lr=1e-3", "trainer.lr=1e-4", "trainer.lr_decay=linear"], "trainer.min_lr", "above lr"),
    (["trainer.min_lr=1e-7"], "trainer.min_lr", "no effect with lr_decay: constant"),
    (["trainer.lr_decay_steps=10"], "trainer.lr_decay_steps", "no effect"),
    (["trainer.lr_warmup_steps=20", "run.steps=20"], "trainer.lr_warmup_steps", "run.steps=20"),
    (["trainer.lr_warmup_steps=5", "trainer.lr_decay=cosine", "trainer.lr_decay_steps=5", "run.steps=50"],
     "trainer.lr_warmup_steps", "lr_decay_steps=5"),
    # ETP x EP must tile the ranks of a pipeline stage
    (["trainer.tp=2", "trainer.ep=2", "launch.trainer_procs=2"], "launch.trainer_procs", "ep*etp=4"),
    (["algo.routing_replay=true", "trainer.recompute=full", "trainer.pp=2", "launch.trainer_procs=2"],
     "algo.routing_replay", "routers run again in the backward"),
    ([*CUDA, "trainer.cp=2", "launch.trainer_procs=2", "algo.length_norm=seq_mean"], "algo.length_norm",
     "chunks of a sample"),
    ([*CUDA, "trainer.cp=2", "launch.trainer_procs=2", "algo.router_agreement=true"], "algo.routing_replay",
     "context parallelism"),
    (["trainer.megatron.bf16=true"], "trainer.megatron.bf16", "trainer.precision"),
    (["trainer.megatron.recompute_granularity=full"], "trainer.megatron.recompute_granularity", "trainer.recompute"),
    (["trainer.megatron.num_layers=8"], "trainer.megatron.num_layers", "config.json"),
    (["trainer.megatron.calculate_per_token_loss=false"], "trainer.megatron.calculate_per_token_loss", "normalised"),
])
def test_bad_combinations_are_refused_with_key_and_reason(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.path == key, str(err.value)
    assert reason in str(err.value)


def test_fitting_combinations_load():
    cfg = load_config(None, ["trainer.tp=2", "trainer.ep=2", "trainer.etp=1", "launch.trainer_procs=2",
                             "trainer.sequence_parallel=true", "trainer.recompute=full", "trainer.recompute_num_layers=2",
                             "trainer.recompute_method=block", "trainer.precision=bf16", "trainer.lr_warmup_steps=5",
                             "trainer.lr_decay=cosine", "trainer.min_lr=1e-7", "trainer.moe_token_dispatcher=alltoall",
                             "trainer.overlap_grad_reduce=true", "trainer.megatron.recompute_modules=[core_attn]",
                             "controller.verify_checksums=false"])
    t = cfg.trainer
    assert (t.expert_tp, t.data_parallel_size(2)) == (1, 1)
    assert t.megatron == {"recompute_modules": ["core_attn"]}  # --set trainer.megatron.<field>=<v> reaches the dict
    gpu = load_config(None, [*CUDA, "trainer.cp=2", "trainer.max_seq_len=4096", "launch.trainer_procs=2",
                             "trainer.moe_grouped_gemm=true", "trainer.moe_token_dispatcher=flex",
                             "trainer.optimizer_cpu_offload=true", "trainer.fusions=true"])
    assert gpu.trainer.data_parallel_size(2) == 1  # cp takes the 2 ranks


def test_checksum_rule_follows_the_trainer_precision():
    """A bf16 trainer exports bf16 snapshots: an embedded engine verifies them only in bfloat16."""
    with pytest.raises(ConfigError, match="trainer.precision bf16"):
        load_config(None, ["trainer.precision=bf16"])
    cfg = load_config(None, ["trainer.precision=bf16", "rollout.dtype=bfloat16"])
    assert cfg.controller.verify_checksums
