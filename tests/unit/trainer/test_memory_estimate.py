"""The per-rank memory estimate: each knob moves the term it should, and the dry run refuses a
layout that does not fit ``cluster.gpu_memory_gb`` (the shipped 30B config fits 80 GiB only with its
bf16 + full recompute settings)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dora_megatron.config.schema import load_config
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.launch.layout import memory_problem, trainer_layout_problem
from dora_megatron.models.hf_config import spec_from_dict
from dora_megatron.trainer.memory import GIB, estimate

ROOT = Path(__file__).resolve().parents[3]
QWEN30B = ROOT / "configs" / "models" / "Qwen3-30B-A3B"


def _arch():
    return spec_from_dict(json.loads((QWEN30B / "config.json").read_text()))


def test_parameter_count_is_the_models():
    """One rank of tp=ep=pp=1 holds all 30.5 B parameters (the model card's total)."""
    est = estimate(_arch(), TrainerConfig(device="cuda", max_seq_len=128), world_size=1)
    assert 30.3e9 < est.param_count < 30.7e9


def test_each_knob_moves_its_term():
    arch = _arch()
    base = TrainerConfig(device="cuda", tp=4, ep=8, max_seq_len=8192)
    ref = estimate(arch, base, 32)
    bf16 = estimate(arch, replace(base, precision="bf16"), 32)
    assert bf16.params == ref.params / 2 and bf16.grads == ref.grads  # fp32 main grads either way
    assert bf16.optimizer > ref.optimizer  # + the fp32 main parameters
    assert abs(bf16.activations / ref.activations - 0.5) < 0.01  # bf16 activations (the router scores stay fp32)
    full = estimate(arch, replace(base, recompute="full"), 32)
    assert full.activations < ref.activations / 10
    # with TE's fused attention there is no s x s score tensor for selective recompute to drop
    assert estimate(arch, replace(base, recompute="selective"), 32).activations == ref.activations
    local = replace(base, spec="local")
    assert estimate(arch, replace(local, recompute="selective"), 32).activations < estimate(arch, local, 32).activations
    assert estimate(arch, replace(base, use_distributed_optimizer=False), 32).optimizer > ref.optimizer
    assert estimate(arch, replace(base, optimizer_cpu_offload=True), 32).optimizer == 0
    assert estimate(arch, replace(base, tp=8, ep=4), 32).params < ref.params
    assert estimate(arch, replace(base, max_seq_len=4096), 32).activations < ref.activations


def test_shipped_30b_config_fits_and_its_fp32_form_is_refused():
    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b_multinode.yaml", [f"model.path={QWEN30B}"])
    assert memory_problem(cfg) is None and trainer_layout_problem(cfg) is None
    fp32 = load_config(ROOT / "configs" / "qwen3_30b_a3b_multinode.yaml",
                       [f"model.path={QWEN30B}", "trainer.precision=fp32", "trainer.recompute=none"])
    problem = trainer_layout_problem(fp32)
    assert problem and problem.startswith("cluster.gpu_memory_gb=80: the trainer needs an estimated")
    assert estimate(_arch(), fp32.trainer, 32).total > 80 * GIB
