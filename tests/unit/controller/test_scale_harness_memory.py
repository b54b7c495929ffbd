"""``tools/controller_scale.py``'s memory per held token: the cost of each further token while the
held tokens rise, apart from what the run holds whatever its tokens."""

from __future__ import annotations

from tests.helpers.tools import load_tool

scale = load_tool("controller_scale")


def test_the_slope_leaves_out_a_fixed_cost():
    held = scale.HeldTokens()
    # 50 MB held from the start whatever the tokens (connections), then 8 B per token
    held.rising = [(1_000_000, 50_000_000 + 8_000_000), (2_000_000, 50_000_000 + 16_000_000),
                   (4_000_000, 50_000_000 + 32_000_000)]
    assert abs(held.slope() - 8.0) < 1e-9


def test_too_few_samples_give_no_slope():
    held = scale.HeldTokens()
    held.rising = [(1, 10), (2, 20)]
    assert held.slope() is None
