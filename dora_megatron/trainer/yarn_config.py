"""Megatron-Core's ``TransformerConfig`` with the YaRN fields its GPT path reads.

WHY a subclass: Megatron-Core 0.16.1's ``GPTModel`` builds ``YarnRotaryEmbedding`` for
``position_embedding_type="yarn"`` from ``config.yarn_rotary_scaling_factor`` and five more
``yarn_*`` attributes, and ``SelfAttention`` scales cos/sin by the concentration factor it derives
from them (``_yarn_get_concentration_factor_from_config``), but ``TransformerConfig`` declares none
of them (only ``MLATransformerConfig`` has YaRN fields, under other names). Declaring them as typed
fields keeps the config one dataclass that Megatron checks and copies as usual, instead of
attributes set on an instance afterwards. Imported only when a non-MLA model uses YaRN
(:func:`dora_megatron.trainer.megatron_args.transformer_config_class`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.transformer import TransformerConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """``TransformerConfig`` + the ``yarn_*`` fields ``GPTModel`` / ``SelfAttention`` read (their
    defaults are ``YarnRotaryEmbedding``'s)."""

    yarn_rotary_scaling_factor: float = 1.0
    """YaRN's ``factor``: how much longer than the original length the context is."""

    yarn_original_max_position_embeddings: int = 4096
    """The pre-training context length the correction range is computed against."""

    yarn_beta_fast: float = 32.0
    """Rotations above which a frequency is extrapolated (kept)."""

    yarn_beta_slow: float = 1.0
    """Rotations below which a frequency is interpolated (divided by the factor)."""

    yarn_mscale: Optional[float] = None
    """With ``yarn_mscale_all_dim``, the numerator of the cos/sin scaling; None: 0.1 ln(factor) + 1."""

    yarn_mscale_all_dim: Optional[float] = None
    """With ``yarn_mscale``, the denominator of the cos/sin scaling; None: 0.1 ln(factor) + 1."""

    yarn_correction_range_round_to_int: bool = True
    """Round the correction range to whole dimensions (transformers' ``truncate``)."""


def partial_rotary_yarn(config: YarnTransformerConfig, rotary_dim: int, rotary_base: float) -> Any:
    """The YaRN rotary of a partial-rotary model (GLM-4.5's ``partial_rotary_factor``): frequencies
    over the ``rotary_dim`` leading dimensions of a head, as transformers computes YaRN for it.

    WHY: ``GPTModel`` builds ``YarnRotaryEmbedding`` with ``kv_channels`` (the whole head) as the
    dimension its frequencies and correction range are computed over; ``rotary_percent`` only trims
    the non-YaRN ``RotaryEmbedding``. Built over ``rotary_dim`` instead, its embedding is
    ``rotary_dim`` wide, and Megatron's ``apply_rotary_pos_emb`` rotates that many leading
    dimensions of each head and passes the rest through (``rope_utils.py``: ``rot_dim =
    freqs.shape[-1]``), which is transformers' partial rotary. The cos/sin scaling attention applies
    is read from the config's ``yarn_*`` fields, so it is unchanged."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    return YarnRotaryEmbedding(
        kv_channels=rotary_dim, rotary_percent=1.0, rotary_interleaved=config.rotary_interleaved,
        rotary_base=rotary_base, use_cpu_initialization=config.use_cpu_initialization,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow, mscale=config.yarn_mscale,
        mscale_all_dim=config.yarn_mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int)
