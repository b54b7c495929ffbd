"""The trainer section -> Megatron's own config classes: each typed key reaches the Megatron fields
it owns, ``trainer.megatron`` is applied to every class that has the field, unknown names are refused
naming the closest field, and the LR schedule is Megatron's OptimizerParamScheduler."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.trainer import megatron_args as ma
from dora_megatron.trainer.model import arch_from_hf_config, build_transformer_config

MOE = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
       "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
DENSE = {**{k: v for k, v in MOE.items() if not k.startswith(("num_experts", "moe_"))}, "model_type": "qwen3"}


def test_typed_knobs_reach_transformer_config():
    moe, dense = arch_from_hf_config(MOE), arch_from_hf_config(DENSE)
    c = build_transformer_config(moe, TrainerConfig(precision="bf16", recompute="full", recompute_method="block",
                                                    recompute_num_layers=2, tp=2, ep=2, etp=1,
                                                    moe_token_dispatcher="alltoall"))
    assert (c.params_dtype, c.bf16, c.fp16, c.pipeline_dtype) == (torch.bfloat16, True, False, torch.bfloat16)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)
    assert c.sequence_parallel  # forced: Megatron requires it for MoE with TP > 1
    assert (c.expert_tensor_parallel_size, c.moe_token_dispatcher_type) == (1, "alltoall")
    assert not build_transformer_config(dense, TrainerConfig(tp=2)).sequence_parallel
    assert build_transformer_config(dense, TrainerConfig(tp=2, sequence_parallel=True)).sequence_parallel
    sel = build_transformer_config(dense, TrainerConfig(recompute="selective"))
    assert sel.recompute_granularity == "selective" and sel.recompute_modules == ["core_attn"]
    vpp = build_transformer_config(moe, TrainerConfig(pp=2, vpp=2))
    assert vpp.virtual_pipeline_model_parallel_size == 2 and not vpp.batch_p2p_comm
    with pytest.raises(ValueError, match=r"trainer.pp \* trainer.vpp = 8"):
        build_transformer_config(moe, TrainerConfig(pp=2, vpp=4))


def test_dispatcher_and_fusion_defaults_follow_the_device_and_spec():
    moe = arch_from_hf_config(MOE)
    assert ma.dispatcher(TrainerConfig()) == "allgather" and ma.dispatcher(TrainerConfig(device="cuda")) == "alltoall"
    te = ma.transformer_kwargs(moe, TrainerConfig(device="cuda"), "te")
    local = ma.transformer_kwargs(moe, TrainerConfig(device="cuda"), "local")
    fused = ("bias_activation_fusion", "apply_rope_fusion", "gradient_accumulation_fusion", "moe_permute_fusion")
    assert all(te[k] for k in fused) and not any(local[k] for k in fused)
    assert not any(ma.transformer_kwargs(moe, TrainerConfig(device="cuda", fusions=False), "te")[k] for k in fused)


def test_megatron_passthrough_reaches_each_class_that_has_the_field():
    cfg = TrainerConfig(megatron={"recompute_modules": ["core_attn", "mlp"], "bucket_size": 1234,
                                  "decoupled_weight_decay": False})
    c = build_transformer_config(arch_from_hf_config(DENSE), replace(cfg, recompute="selective"))
    assert c.recompute_modules == ["core_attn", "mlp"]
    assert ma.ddp_kwargs(cfg)["bucket_size"] == 1234 and "bucket_size" not in ma.optimizer_kwargs(cfg)
    assert ma.optimizer_kwargs(cfg)["decoupled_weight_decay"] is False
    assert ma.optimizer_kwargs(TrainerConfig(precision="bf16"))["bf16"] is True


def test_unknown_megatron_fields_are_refused_naming_the_closest():
    problems = ma.megatron_field_problems({"recompute_modulez": ["core_attn"], "moe_router_fusion": True,
                                           "zzz_not_a_field": 1})
    assert len(problems) == 2
    assert "trainer.megatron.recompute_modulez" in problems[0] and "did you mean 'recompute_modules'" in problems[0]
    assert "trainer.megatron.zzz_not_a_field" in problems[1] and "did you mean" not in problems[1]


class _Groups:
    """What OptimizerParamScheduler reads and writes: the optimizer's param groups."""

    def __init__(self) -> None:
        self.param_groups = [{"default_config": True, "wd_mult": 1.0}, {"default_config": False, "wd_mult": 0.0}]


def test_schedule_is_megatrons_scheduler_with_update_k_at_step_k():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = TrainerConfig(lr=1e-3, lr_warmup_steps=4, lr_decay="linear", min_lr=1e-4, weight_decay=0.1)
    opt = _Groups()
    sched = OptimizerParamScheduler(opt, **ma.scheduler_kwargs(cfg, total_steps=10))
    lrs = []
    for _ in range(10):  # the worker steps the schedule once before each update
        sched.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # warmup: update k uses lr * k / 4
    assert lrs[4] == pytest.approx(1e-3 - 0.9e-3 / 6) and lrs[-1] == pytest.approx(1e-4)  # linear to min_lr
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1) and opt.param_groups[1]["weight_decay"] == 0.0
    constant = _Groups()
    sched = OptimizerParamScheduler(constant, **ma.scheduler_kwargs(TrainerConfig(lr=1e-3), total_steps=3))
    sched.step(1)
    assert constant.param_groups[0]["lr"] == 1e-3


def _checkpointed_schedule(cfg: TrainerConfig, run_steps: int, steps: int) -> dict:
    """The schedule state a checkpoint of a ``run_steps`` run holds after ``steps`` updates."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(_Groups(), **ma.scheduler_kwargs(cfg, total_steps=run_steps))
    sched.step(steps)
    return sched.state_dict()


def _resumed_lrs(cfg: TrainerConfig, run_steps: int, saved: dict, updates: int) -> list[float]:
    """Resume ``saved`` into the scheduler the worker builds for a ``run_steps`` run; the LRs of the
    next ``updates`` updates (the worker steps the schedule once before each update)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from dora_megatron.trainer.worker import restore_schedule

    opt = _Groups()
    sched = OptimizerParamScheduler(opt, **ma.scheduler_kwargs(cfg, total_steps=run_steps))
    restore_schedule(sched, saved, cfg, "ckpt/v000006")
    lrs = []
    for _ in range(updates):
        sched.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_a_constant_schedule_resumes_with_another_run_length():
    cfg = TrainerConfig(lr=1e-3, lr_warmup_steps=8)
    saved = _checkpointed_schedule(cfg, run_steps=10, steps=6)
    assert saved["lr_decay_steps"] == 10  # derived from run.steps, which Megatron alone would compare
    # still warming up: updates 7, 8 use lr * k / 8, then the constant lr
    assert _resumed_lrs(cfg, 20, saved, 3) == pytest.approx([7 / 8 * 1e-3, 1e-3, 1e-3])


def test_a_decaying_schedule_following_run_steps_needs_the_override_to_change_length():
    cfg = TrainerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay="linear")
    saved = _checkpointed_schedule(cfg, run_steps=10, steps=6)
    with pytest.raises(ValueError) as refused:
        _resumed_lrs(replace(cfg, lr=2e-3), 20, saved, 1)
    msg = str(refused.value)
    assert "ckpt/v000006" in msg and "trainer.override_opt_param_scheduler" in msg
    assert "trainer.lr: 0.002 in this run, 0.001 in the checkpoint" in msg
    assert "the decay length (trainer.lr_decay_steps 0: run.steps): 20 in this run, 10 in the checkpoint" in msg
    # linear from 1e-3 after 2 warmup updates to 1e-4 at 20: update k uses 1e-4 + 0.9e-3 * (1 - (k - 2) / 18)
    override = replace(cfg, override_opt_param_scheduler=True)
    assert _resumed_lrs(override, 20, saved, 2) == pytest.approx([7.5e-4, 7e-4])
    # the checkpoint's schedule (decay ends at 10): 1e-4 + 0.9e-3 * (1 - (k - 2) / 8)
    keep = replace(cfg, use_checkpoint_opt_param_scheduler=True)
    assert _resumed_lrs(keep, 20, saved, 2) == pytest.approx([4.375e-4, 3.25e-4])


def test_an_explicit_decay_length_resumes_with_another_run_length():
    cfg = TrainerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay="linear", lr_decay_steps=20)
    saved = _checkpointed_schedule(cfg, run_steps=10, steps=6)
    assert _resumed_lrs(cfg, 30, saved, 2) == pytest.approx([7.5e-4, 7e-4])  # as above: decay ends at 20


def test_override_and_use_checkpoint_schedule_exclude_each_other():
    from dora_megatron.config.base import ConfigError

    with pytest.raises(ConfigError, match="trainer.override_opt_param_scheduler.*use_checkpoint_opt_param_scheduler"):
        TrainerConfig(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True).check("trainer")
