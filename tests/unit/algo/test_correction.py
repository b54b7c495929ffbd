"""Rollout correction (masked IS token/sequence level, IcePop) checked by hand on small tensors."""

import math

import pytest
import torch

from dora_megatron.algo.correction import CorrectionSettings, rollout_correction, sequence_log_ratio
from dora_megatron.algo.losses import LossSettings, policy_loss, settings_from_config
from dora_megatron.config.algo import AlgoConfig
from dora_megatron.config.base import ConfigError


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# trainer/rollout ratios per token: 1.0, 3.0 (above 2), 0.25 (below 0.5), 1.5
RATIOS = [1.0, 3.0, 0.25, 1.5]


def _lps():
    trainer = torch.zeros(1, 4)
    rollout = -torch.log(_t(RATIOS))  # exp(trainer - rollout) = RATIOS
    return trainer, rollout


def test_token_mis_drops_out_of_band_tokens_from_loss_and_normaliser():
    trainer, rollout = _lps()
    c = rollout_correction(trainer, rollout, torch.ones(1, 4), CorrectionSettings("token_mis", 0.5, 2.0))
    assert c.loss_mask.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    assert c.weight.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert c.dropped.sum().item() == 2
    # through the loss: -A per kept token, normalised over the 2 kept tokens only
    s = LossSettings(correction=CorrectionSettings("token_mis", 0.5, 2.0))
    out = policy_loss(torch.zeros(1, 4), torch.zeros(1, 4), _t(1.0), torch.ones(1, 4), s,
                      rollout_logprobs=rollout, trainer_logprobs=trainer)
    assert (out.loss_sum.item(), out.denominator, out.num_tokens) == (-2.0, 2, 4)
    assert out.metric_sums["correction_dropped_fraction"].item() == 2


def test_token_mis_gradient_is_zero_on_dropped_tokens():
    trainer, rollout = _lps()
    lp = torch.zeros(1, 4, requires_grad=True)
    s = LossSettings(correction=CorrectionSettings("token_mis", 0.5, 2.0))
    policy_loss(lp, torch.zeros(1, 4), _t(1.0), torch.ones(1, 4), s, rollout_logprobs=rollout,
                trainer_logprobs=trainer).loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert lp.grad[0, 0].item() == pytest.approx(-0.5)  # d(-A r)/dlp / 2 kept tokens


def test_token_mis_with_tis_cap_weights_kept_tokens():
    trainer, rollout = _lps()
    c = rollout_correction(trainer, rollout, torch.ones(1, 4), CorrectionSettings("token_mis", 0.5, 2.0, tis_cap=1.2))
    assert c.weight[0].tolist() == pytest.approx([1.0, 1.2, 0.25, 1.2])
    assert c.loss_mask.tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_icepop_weights_kept_tokens_by_ratio_and_keeps_normaliser():
    trainer, rollout = _lps()
    c = rollout_correction(trainer, rollout, torch.ones(1, 4), CorrectionSettings("icepop", 0.5, 2.0))
    assert c.weight[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5])
    assert c.loss_mask.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    s = LossSettings(correction=CorrectionSettings("icepop", 0.5, 2.0))
    out = policy_loss(torch.zeros(1, 4), torch.zeros(1, 4), _t(1.0), torch.ones(1, 4), s,
                      rollout_logprobs=rollout, trainer_logprobs=trainer)
    assert out.loss_sum.item() == pytest.approx(-2.5) and out.denominator == 4


def test_seq_mis_drops_whole_samples_by_geometric_or_product_ratio():
    trainer = torch.zeros(2, 3)
    # sample 0 ratios 2, 2, 0.5 -> geometric mean 2^(1/3) = 1.26 (in band), product 2 (in band at 2.0)
    # sample 1 ratios 4, 4, 1 (last token is padding) -> geometric mean 4 (out), product 16 (out)
    rollout = -torch.log(_t([2.0, 2.0, 0.5], [4.0, 4.0, 1.0]))
    mask = _t([1, 1, 1], [1, 1, 0])
    c = rollout_correction(trainer, rollout, mask, CorrectionSettings("seq_mis", 0.5, 2.0))
    assert c.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert c.dropped.tolist() == [[0, 0, 0], [1, 1, 0]]
    # the two aggregates differ: sample 0 with band [0.5, 1.5] is kept by geometric, dropped by product
    geo = rollout_correction(trainer, rollout, mask, CorrectionSettings("seq_mis", 0.5, 1.5, "geometric"))
    prod = rollout_correction(trainer, rollout, mask, CorrectionSettings("seq_mis", 0.5, 1.5, "product"))
    assert geo.loss_mask[0].tolist() == [1, 1, 1] and prod.loss_mask[0].tolist() == [0, 0, 0]
    log_rho = sequence_log_ratio(trainer - rollout, mask, "product")
    assert log_rho.tolist() == pytest.approx([math.log(2.0), math.log(16.0)], rel=1e-5)


def test_seq_mis_denominator_counts_kept_samples_with_seq_mean():
    trainer = torch.zeros(2, 2)
    rollout = -torch.log(_t([1.0, 1.0], [5.0, 5.0]))
    s = LossSettings(length_norm="seq_mean", correction=CorrectionSettings("seq_mis", 0.5, 2.0))
    out = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), _t(1.0, 1.0), torch.ones(2, 2), s,
                      rollout_logprobs=rollout, trainer_logprobs=trainer)
    assert (out.loss_sum.item(), out.denominator) == (-1.0, 1)


def test_none_keeps_everything_and_on_policy_is_untouched():
    trainer, rollout = _lps()
    for mode in ("none", "token_mis", "seq_mis", "icepop"):
        same = rollout_correction(trainer, trainer, torch.ones(1, 4), CorrectionSettings(mode))
        assert same.loss_mask.tolist() == [[1.0] * 4] and same.weight.tolist() == [[1.0] * 4], mode
    c = rollout_correction(trainer, rollout, torch.ones(1, 4), CorrectionSettings("none"))
    assert c.loss_mask.tolist() == [[1.0] * 4] and c.dropped.sum().item() == 0


def test_config_selects_correction_and_refuses_bad_band():
    s = settings_from_config(AlgoConfig(rollout_correction="icepop", correction_low=0.4, correction_high=3.0,
                                        seq_mis_agg="product"))
    assert (s.correction.mode, s.correction.low, s.correction.high, s.correction.seq_agg) == ("icepop", 0.4, 3.0,
                                                                                               "product")
    assert s.needs_trainer_logprobs and not settings_from_config(AlgoConfig()).needs_trainer_logprobs
    with pytest.raises(ConfigError, match="correction_low"):
        AlgoConfig(correction_low=1.2, correction_high=2.0).check("algo")
    with pytest.raises(KeyError, match="rollout_correction"):
        rollout_correction(*_lps(), torch.ones(1, 4), CorrectionSettings("bogus"))
