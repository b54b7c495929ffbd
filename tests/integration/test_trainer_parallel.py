"""Megatron trainer on CPU/gloo against Hugging Face transformers, in several TP/PP/EP layouts.

Each layout runs ``dora_megatron.trainer.scenarios step`` in real processes (torchrun, 2 ranks):
logits must match transformers (fp32), and one training step must give the same loss, grad norm
and updated weights as the 1-rank run. MoE covers TP (with sequence parallelism), EP and PP; the
dense model is checked at 1 rank and with TP=2 through ``tools/check_parity.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dora_megatron.ports import free_port

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR = 1e-3


def run_scenario(args: list[str], nproc: int, out: str, timeout: int = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if nproc == 1:
        cmd = [sys.executable, "-m", "dora_megatron.trainer.scenarios"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", "dora_megatron.trainer.scenarios"]
    proc = subprocess.run(cmd + args + ["--out", out, "--lr", str(LR)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out)


def make_hf_model(path: str, moe: bool) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                                   norm_topk_prob=True, intermediate_size=256, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **common))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"dense": make_hf_model(str(root / "dense"), moe=False), "moe": make_hf_model(str(root / "moe"), moe=True)}


@pytest.fixture(scope="module")
def baselines(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    return {k: run_scenario(["step", "--hf", d], 1, str(root / f"{k}.pt")) for k, d in models.items()}


def _hf_reference(hf_dir: str) -> torch.Tensor:
    from dora_megatron.trainer.parity import fixed_inputs, hf_logits

    return hf_logits(hf_dir, fixed_inputs(128))


def _initial_hf(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def test_single_rank_matches_transformers_and_trains(models, baselines):
    for kind, hf_dir in models.items():
        res = baselines[kind]
        assert (res["logits"] - _hf_reference(hf_dir)).abs().max().item() < 1e-4
        m = res["metrics"]
        assert m["update_successful"] == 1.0 and m["num_samples"] == 4
        assert 0 < m["clip_fraction"] < 1  # rollout log-probs were perturbed: some tokens clip
        initial = _initial_hf(hf_dir)
        assert set(res["weights"]) == set(initial)
        moved = max((res["weights"][k] - initial[k]).abs().max().item() for k in initial)
        assert LR / 2 < moved < 2 * LR  # one Adam step moves weights by about lr


@pytest.mark.parametrize("kind,layout", [("moe", "--tp 2"), ("moe", "--ep 2"), ("moe", "--pp 2")])
def test_two_rank_layout_matches_single_rank(models, baselines, tmp_path, kind, layout):
    res = run_scenario(["step", "--hf", models[kind], *layout.split()], 2, str(tmp_path / "r.pt"))
    base = baselines[kind]
    assert (res["logits"] - _hf_reference(models[kind])).abs().max().item() < 1e-4
    for key in ("loss", "entropy", "clip_fraction", "rollout_vs_trainer_logprob_diff", "grad_norm", "num_tokens"):
        assert res["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-6), key
    assert set(res["weights"]) == set(base["weights"])
    for name, w in base["weights"].items():
        # Adam's first step is ~lr*sign(g): allow a tenth of lr for fp32 reduction-order noise
        assert (res["weights"][name] - w).abs().max().item() < LR / 10, name


def test_resume_from_checkpoint_is_bit_exact(models, tmp_path):
    pytest.importorskip("psutil")  # megatron's torch_dist checkpoint writer needs it
    ckpt = str(tmp_path / "ckpt")
    args = ["--hf", models["moe"], "--ep", "2", "--ckpt", ckpt]
    straight = run_scenario(["resume-save", *args], 2, str(tmp_path / "a.pt"))
    resumed = run_scenario(["resume-load", *args], 2, str(tmp_path / "b.pt"))
    assert resumed["metrics"] == straight["metrics"]
    assert resumed["metrics"]["step"] == 2.0
    for name, w in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def test_check_parity_tool_prints_small_difference(models):
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "check_parity.py"), "--hf", models["dense"],
                           "--tp", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert float(last) < 1e-4
