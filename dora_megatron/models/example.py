"""A model directory and a prompt set shaped like the ones users bring, made locally in seconds.

Why: a user arrives with a Hugging Face checkpoint (a Qwen3-MoE with its byte-level BPE tokenizer,
chat template and generation config) and a verl/DAPO Parquet file. The presets take none of those
paths (a character vocabulary, no template, digit tasks), so this module writes the real shapes at
toy size for ``tools/make_example_model.py``, the newcomer's config ``configs/cpu_own_model.yaml``
and the tests:

* ``model/``: a Qwen3-MoE written by transformers' ``save_pretrained`` (random init, seeded), a
  byte-level BPE tokenizer trained with ``tokenizers`` and saved through transformers'
  ``PreTrainedTokenizerFast`` (so ``AutoTokenizer`` loads it) with ``<|im_start|>`` / ``<|im_end|>``
  and a Qwen-style chat template (``enable_thinking`` like Qwen3's), and ``generation_config.json``
  (EOS ``<|im_end|>`` and ``<|endoftext|>``). Its vocabulary is padded past the tokenizer's, as
  real checkpoints' are; its head size (32) is one vLLM's CPU attention supports.
* ``train.parquet``: DAPO-shaped rows written with pyarrow: a chat-list ``prompt`` (system + user),
  ``reward_model.ground_truth``, ``data_source``, ``ability`` and ``extra_info``.

The reward file that goes with the data is ``examples/own_model/reward.py`` (verl's
``compute_score`` signature).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
DATA_SOURCE = "example/arithmetic"
SYSTEM_PROMPT = "You are a careful assistant. Think step by step, then put the final answer in \\boxed{}."

#: A Qwen-style chat template (ChatML turns; ``enable_thinking=false`` closes an empty think block, as
#: Qwen3's does). It is data of the example model, rendered only by transformers.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class ExamplePaths:
    model_dir: Path
    data: Path


def arithmetic_rows(count: int, seed: int = 0) -> list[dict]:
    """DAPO-shaped rows of small sums (the verl layout: chat ``prompt``, ``reward_model``, ...)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": f"What is {a} + {b}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i, "split": "train", "a": a, "b": b},
        })
    return rows


def build_tokenizer(corpus: list[str], vocab_size: int = 384):
    """A byte-level BPE trained on ``corpus`` (``tokenizers``), as transformers' fast tokenizer with the
    chat template; ``<|im_end|>`` is its EOS and ``<|endoftext|>`` its padding, as in Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=32768)
    fast.add_tokens(list(THINK_TOKENS))  # ordinary added tokens (kept when decoding), as in Qwen3
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config_kwargs(family: str, hidden_size: int = 64) -> dict[str, Any]:
    """The family-specific keyword arguments of a tiny model of ``family`` (a ``model_type`` of
    :mod:`dora_megatron.models.families`): 2 layers, 4 experts top-2 where the family is MoE, each
    family's own pieces switched on (Qwen2-MoE: a gated shared expert and q/k/v biases; GLM-4.5: see its row)."""
    from dora_megatron.models import families

    families.family(family, "--family")
    h = hidden_size
    moe = dict(num_experts_per_tok=2)
    per_family: dict[str, dict[str, Any]] = {
        "qwen3": dict(intermediate_size=2 * h, head_dim=32),
        "qwen3_moe": dict(intermediate_size=2 * h, moe_intermediate_size=h // 2, head_dim=32, num_experts=4,
                          norm_topk_prob=True, **moe),
        "qwen2_moe": dict(intermediate_size=2 * h, moe_intermediate_size=h // 2, num_experts=4,
                          shared_expert_intermediate_size=h, norm_topk_prob=False, **moe),
        "mixtral": dict(intermediate_size=h // 2, num_local_experts=4, **moe),
        # every GLM-4.5 piece on: half-rotary heads, QK-norm, q/k/v bias, a dense first layer, a shared
        # expert, sigmoid routing over 8 experts in 2 groups (the best 1 kept) scaled by 2.5
        # (``head_dim`` written out, as the Hub's GLM-4.5 configs do: vLLM reads it, transformers
        # derives it from hidden_size / num_attention_heads and does not save it)
        "glm4_moe": dict(intermediate_size=2 * h, moe_intermediate_size=h // 2, n_routed_experts=8, n_shared_experts=1,
                         first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=h // 4,
                         **moe),
        # MLA (q and kv latents, a rotary part narrower than the heads), 8 experts in 2 groups of which
        # the best 1 is searched for the top-2 (group scores by their top 2, which Megatron needs), a
        # shared expert, layer 0 dense; every head its own kv head (MLA has no GQA); the router keys
        # of the Hub's DeepSeek-V3 config (``moe_layer_freq``, ``topk_method``, ``scoring_func``),
        # which SGLang and vLLM read and transformers' config class does not write
        "deepseek_v3": dict(intermediate_size=2 * h, moe_intermediate_size=h // 2, n_routed_experts=8,
                            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=h // 2, kv_lora_rank=h // 4,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                            moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", **moe),
    }
    if family not in per_family:
        raise ValueError(f"--family {family!r}: no tiny example defined (have: {', '.join(sorted(per_family))})")
    return per_family[family]


def save_tiny_model(model_dir: Path, tokenizer: Any, *, family: str = "qwen3_moe", seed: int = 0,
                    dtype: str = "bfloat16", hidden_size: int = 64, rope_theta: float = 1000000.0,
                    **sampling: Any) -> None:
    """Save into ``model_dir`` a tiny model of ``family`` (random init seeded; see
    :func:`tiny_config_kwargs`) for ``tokenizer``: its vocabulary padded past the tokenizer's, as
    real checkpoints' are; EOS ``<|im_end|>`` (and ``<|endoftext|>`` in the generation config,
    with ``sampling``). Saved by transformers' own classes, so the directory is what a user has."""
    import torch
    import transformers
    from transformers import GenerationConfig

    end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = -(-len(tokenizer) // 64) * 64 + 64  # padded past the tokenizer, like real checkpoints
    config = transformers.CONFIG_MAPPING[family](**{
        **dict(vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.05, max_position_embeddings=4096,
               rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, bos_token_id=None,
               eos_token_id=end, pad_token_id=pad),
        **tiny_config_kwargs(family, hidden_size)})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    from dora_megatron.models.hf_config import keeps_fp32

    with torch.no_grad():  # what transformers keeps in fp32 (GLM-4.5's router), as its from_pretrained would
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if keeps_fp32(family, name):
                t.data = t.data.float()
    model.generation_config = GenerationConfig(eos_token_id=[end, pad], pad_token_id=pad, do_sample=True, **sampling)
    model.save_pretrained(str(model_dir))


def write_example(out: str | Path, *, rows: int = 64, seed: int = 0, dtype: str = "bfloat16",
                  family: str = "qwen3_moe") -> ExamplePaths:
    """Write ``out/model`` (tokenizer, chat template, generation config, a tiny model of ``family``
    saved by transformers in ``dtype``) and ``out/train.parquet`` (``rows`` DAPO-shaped rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    data = arithmetic_rows(rows, seed)
    corpus = [m["content"] for r in data for m in r["prompt"]] + [
        "The answer is \\boxed{42}.", "assistant user system", "0123456789 + - = ? ."] * 4
    tokenizer = build_tokenizer(corpus)
    tokenizer.save_pretrained(str(model_dir))
    save_tiny_model(model_dir, tokenizer, family=family, seed=seed, dtype=dtype, temperature=0.7, top_p=0.8, top_k=20)
    path = out / "train.parquet"
    pq.write_table(pa.Table.from_pylist(data), str(path))
    return ExamplePaths(model_dir, path)
