"""Model directories as they exist outside this project, for the config-reading tests.

``save_pretrained``: written by the installed transformers itself (random init, seeded), so the
config spells what that version writes (5.x: ``num_local_experts``, ``rope_parameters``).
``hub_spelled``: the same weights with ``config.json`` rewritten the way the Hub's Qwen3 /
Qwen3-MoE checkpoints spell it (transformers 4.x: ``num_experts``, ``rope_theta``,
``rope_scaling: null``, ``torch_dtype``) and, as in older configs, without the keys whose
transformers default applies (``norm_topk_prob``: false; a Qwen3-MoE ``head_dim``: hidden / heads).

The models use a RoPE base other than the default and a larger init std, so a reader that missed
the base, the experts or the routing would give other logits, not nearly the same ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROPE_THETA = 500000.0
VOCAB = 96


def save_pretrained(out: str | Path, moe: bool, seed: int = 0, **moe_extra) -> Path:
    """A tiny Qwen3-MoE (``moe``, its config given ``moe_extra`` too) or Qwen3 written by transformers'
    ``save_pretrained``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, tie_word_embeddings=False, initializer_range=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, eos_token_id=2)
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   norm_topk_prob=False, **{**common, **moe_extra}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(str(out))
    return Path(out)


def hub_spelled(src: str | Path, out: str | Path) -> Path:
    """Copy of ``src`` (from :func:`save_pretrained`) with ``config.json`` in the Hub's spelling."""
    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype=cfg.pop("dtype"),
               transformers_version="4.51.0")
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
        assert cfg.pop("norm_topk_prob") is False and cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]
        del cfg["head_dim"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def save_family(out: str | Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny model of ``family`` (a supported ``model_type``) written by transformers' ``save_pretrained``
    in fp32 (its config given ``overrides`` too, e.g. ``tie_word_embeddings=True``), with every bias,
    gate and norm weight random too (transformers initialises biases at 0, norms at 1 and the routing
    correction bias of GLM-4.5 / DeepSeek-V3 at 0, which would hide a bias or a norm read from the
    wrong tensor)."""
    import transformers

    from dora_megatron.models.example import tiny_config_kwargs

    config = transformers.CONFIG_MAPPING[family](**{
        **dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               tie_word_embeddings=False, initializer_range=0.1, eos_token_id=2,
               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}),
        **tiny_config_kwargs(family, 64), **overrides})
    _save_random(config, out, seed)
    return Path(out)


def _save_random(config, out: str | Path, seed: int) -> None:
    """A model of the transformers ``config`` saved to ``out`` in fp32, every bias, gate, norm and
    routing correction bias random (see :func:`save_family`)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("shared_expert_gate.weight"):
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
        for name, b in model.named_buffers():  # the routing correction bias, large enough to change choices
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape))
    model.save_pretrained(str(out))


#: hand-written ``config.json`` files of each family as checkpoints saved by transformers 4.x spell
#: them (``rope_theta`` and ``rope_scaling`` with ``type``, ``torch_dtype``, GLM's top-level
#: ``partial_rotary_factor``, Qwen1.5-MoE's ``sliding_window`` with ``use_sliding_window: false``,
#: DeepSeek-V3's remote-code keys), at tiny sizes
V4_CONFIGS = Path(__file__).resolve().parent / "hf_configs_v4"


def v4_config(family: str) -> dict:
    """The hand-written transformers-4.x ``config.json`` of ``family`` (:data:`V4_CONFIGS`)."""
    return json.loads((V4_CONFIGS / f"{family}.json").read_text())


def save_v4(out: str | Path, family: str, seed: int = 0) -> Path:
    """A random model (as :func:`save_family`) whose ``config.json`` is the hand-written 4.x one of
    ``family``, byte for byte: transformers builds the model from that file, then the file it
    re-spelled on saving is replaced by the original."""
    import transformers

    config = transformers.CONFIG_MAPPING[family].from_dict(v4_config(family))
    _save_random(config, out, seed)
    shutil.copyfile(V4_CONFIGS / f"{family}.json", Path(out) / "config.json")
    return Path(out)



def fp8_quantize(state: dict, block: tuple[int, int], magnitudes: bool = False) -> tuple[dict, dict]:
    """``state`` block-quantized as DeepSeek-V3 publishes its checkpoints: every 2-D weight of a
    decoder layer but the router's as ``float8_e4m3fn`` with one ``weight_scale_inv`` per ``block``
    tile (the last tile of a dimension ``block`` does not divide is partial); returns (the
    quantized state, the full-precision weights it quantized). ``magnitudes``: each tile is first
    scaled by its own power of ten (1e-3 .. 1e3), so a scale applied to the wrong tile shows."""
    import torch

    gen = torch.Generator().manual_seed(7)
    quantized, reference = {}, {}
    for name, w in state.items():
        reference[name] = w
        if w.dim() != 2 or ".layers." not in name or name.endswith("mlp.gate.weight"):
            quantized[name] = w
            continue
        rows, cols = w.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        w = w.clone()
        scales = torch.empty(grid)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                tile = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
                if magnitudes:
                    w[tile] *= 10.0 ** float(torch.randint(-3, 4, (), generator=gen))
                scales[i, j] = w[tile].abs().max().clamp(min=1e-12) / 448.0  # e4m3's largest value
                q[tile] = (w[tile] / scales[i, j]).to(torch.float8_e4m3fn)
        quantized[name], quantized[name[: -len("weight")] + "weight_scale_inv"] = q, scales
        reference[name] = w
    return quantized, reference


def save_fp8(src: str | Path, out: str | Path, block: tuple[int, int] = (8, 8)) -> Path:
    """``src`` (an HF directory) copied to ``out`` as a block-FP8 checkpoint (:func:`fp8_quantize`,
    ``quantization_config`` added to ``config.json`` as DeepSeek-V3's)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    quantized, _ = fp8_quantize(load_file(str(src / "model.safetensors")), block)
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
