"""Block-quantized FP8 checkpoints (DeepSeek-V3, Kimi-K2, ...), read as full-precision weights.

Why: the checkpoints these families publish store most linear weights as ``float8_e4m3fn`` with
one ``<name>.weight_scale_inv`` per ``weight_block_size`` tile (``quantization_config`` with
``quant_method: fp8``); the trainer trains and the embedded engine serves full-precision weights,
so both read such a checkpoint through :func:`dequantize_state`: a tile's weight is its FP8 values
times its ``weight_scale_inv``. The scale grid is ``ceil(rows / block) x ceil(cols / block)``: the
last tile of a dimension the block does not divide is partial (DeepSeek-V3's 576-row
``kv_a_proj_with_mqa`` with 128-row tiles). What dora writes back (snapshots, converted
checkpoints) is full precision, so its ``config.json`` drops ``quantization_config``
(:func:`without_quantization`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

#: the key of ``config.json`` that describes how the checkpoint is quantized
QUANT_KEY = "quantization_config"
#: the suffix of a quantized weight's per-tile scale (dequantized value = fp8 value x scale)
SCALE_SUFFIX = ".weight_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block(config: Mapping[str, Any], where: str = "config.json") -> tuple[int, int] | None:
    """The ``(rows, cols)`` tile of a block-FP8 checkpoint's ``config`` (a ``config.json`` dict), or
    None when it is not quantized. Any other quantization is refused, naming the field: dora would
    otherwise read its packed integers as weights."""
    quant = config.get(QUANT_KEY)
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"{where}: {QUANT_KEY} must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{where}: {QUANT_KEY}.quant_method {method!r} is not supported (supported: 'fp8' with "
                         "weight_block_size, the DeepSeek-V3 layout); dequantize the checkpoint first")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: {QUANT_KEY}.fmt {fmt!r} is not supported (supported: 'e4m3')")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where}: {QUANT_KEY}.weight_block_size must be two positive integers [rows, cols], got "
                         f"{block!r} (per-tensor FP8 is not supported)")
    return int(block[0]), int(block[1])


def dequantize_weight(quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      name: str = "weight") -> torch.Tensor:
    """``quantized`` (rows x cols FP8) times its tile scales ``scale_inv`` (ceil(rows/br) x
    ceil(cols/bc)), as float32."""
    if quantized.dim() != 2:
        raise ValueError(f"{name}: a block-quantized weight must be 2-D, got shape {tuple(quantized.shape)}")
    rows, cols = quantized.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{name}{SCALE_SUFFIX[len('.weight'):]}: shape {tuple(scale_inv.shape)} does not tile a "
                         f"{rows}x{cols} weight in {block[0]}x{block[1]} blocks (expected {grid})")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return quantized.float() * scales


def dequantize_state(state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                     where: str = "config.json") -> dict[str, torch.Tensor]:
    """``state`` with every quantized weight replaced by its float32 value and the scales dropped;
    ``state`` unchanged (a new dict) when ``config`` is not quantized. A scale without its weight,
    or an FP8 tensor without its scale, is refused by name."""
    block = fp8_block(config, where)
    if block is None:
        stray = sorted(n for n, t in state.items() if t.dtype in FP8_DTYPES)
        if stray:
            raise ValueError(f"{where}: no {QUANT_KEY}, yet {len(stray)} tensor(s) are FP8 (first: {stray[0]})")
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)] + ".weight"
            if weight not in state:
                raise ValueError(f"{name}: a scale without its weight {weight}")
            continue
        scale = state.get(name[: -len(".weight")] + SCALE_SUFFIX) if name.endswith(".weight") else None
        if scale is not None:
            out[name] = dequantize_weight(tensor, scale, block, name)
        elif tensor.dtype in FP8_DTYPES:
            raise ValueError(f"{name}: an FP8 tensor without its {SCALE_SUFFIX[1:]}")
        else:
            out[name] = tensor
    return out


def without_quantization(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` for full-precision weights: ``quantization_config`` dropped."""
    return {k: v for k, v in config.items() if k != QUANT_KEY}
