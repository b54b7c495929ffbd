"""Runs ``tests.helpers.trainer_programs`` in real processes (torchrun for more than one rank) and
builds tiny Hugging Face models; shared by the trainer integration tests."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from dora_megatron.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR = 1e-3


def run_scenario(args: list[str], nproc: int, out: str, timeout: int = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if nproc == 1:
        cmd = [sys.executable, "-m", "tests.helpers.trainer_programs"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", "tests.helpers.trainer_programs"]
    proc = subprocess.run(cmd + args + ["--out", out, "--lr", str(LR)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def run_matrix(items: list[str], nproc: int, models: dict[str, str], out: str, timeout: int = 600) -> list[dict]:
    """``scenarios matrix`` over ``items`` (see ``tests.helpers.trainer_programs.parse_item``)."""
    args = ["matrix", "--models", *(f"{k}={v}" for k, v in models.items()), "--items", *items]
    return run_scenario(args, nproc, out, timeout=timeout)["items"]


def make_hf_model(path: str, moe: bool, layers: int = 2) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                                   norm_topk_prob=True, intermediate_size=256, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **common))
    model.save_pretrained(path)
    return path
