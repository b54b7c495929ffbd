"""Chi-square p-values for the sampling tests (deterministic seeds, stated power)."""

from __future__ import annotations

import torch


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (the regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def gof_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of ``counts`` to ``probs`` (normalised here) over the cells with
    mass; fails if a cell without mass was drawn."""
    keep = probs > 0
    n = counts.sum()
    expected = n * probs[keep] / probs[keep].sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert int(counts[~keep].sum()) == 0, "a token without mass was drawn"
    return chi2_sf(stat, int(keep.sum()) - 1)
