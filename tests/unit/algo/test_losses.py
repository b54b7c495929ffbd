import math

import pytest
import torch

from dora_megatron.algo.losses import ClipBounds, LossSettings, clipped_surrogate, policy_loss, settings_from_config
from dora_megatron.config.algo import AlgoConfig


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ppo_clip_by_hand():
    # ratios e^{log r}: 1.5 (A>0, clipped to 1.2), 0.5 (A>0, unclipped since min picks -A*0.5 > ...),
    # 1.5 (A<0, unclipped: max(1.5, 1.2) -> -A*1.5), 0.5 (A<0, clipped to 0.8)
    old = torch.zeros(1, 4)
    lp = torch.log(_t([1.5, 0.5, 1.5, 0.5]))
    adv = _t([1.0, 1.0, -1.0, -1.0])
    s = LossSettings(bounds=ClipBounds(0.2, 0.2, 0.2, 0.2))
    out = policy_loss(lp, old, adv, torch.ones(1, 4), s)
    # per token: max(-A r, -A clip(r)): [-1.2, -0.5, 1.5, 0.8]
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4, rel=1e-6)
    assert out.denominator == 4
    # gradient removed (clip term selected and strictly larger) on tokens 0 and 3
    assert out.metric_sums["clip_fraction"].item() == 2


def test_gradient_is_zero_on_clipped_tokens():
    lp = torch.log(_t([1.5, 1.1])).requires_grad_()
    out = policy_loss(lp, torch.zeros(1, 2), _t([1.0, 1.0]), torch.ones(1, 2), LossSettings())
    out.loss.backward()
    assert lp.grad[0, 0].item() == 0.0
    # d(-A r)/d lp = -A r / N = -1.1 / 2
    assert lp.grad[0, 1].item() == pytest.approx(-1.1 / 2, rel=1e-6)


def test_triplet_bounds_depend_on_sign_and_dual_clip():
    b = ClipBounds(pos_low=0.1, pos_high=0.3, neg_low=0.2, neg_high=0.4, dual_clip_c=3.0)
    ratio = _t([2.0, 0.5, 1.3, 5.0, 0.5])
    adv = _t([1.0, 1.0, -1.0, -2.0, -1.0])
    loss, clipped = clipped_surrogate(ratio, adv, b)
    # A>0: clip to [0.9, 1.3]: r=2 -> max(-2, -1.3) = -1.3 (clipped); r=0.5 -> max(-0.5, -0.9) = -0.5
    # A<0 (bounds [0.8, 1.4]): r=1.3 -> max(1.3, 1.3) = 1.3; r=5, A=-2 -> max(10, 2.8)=10 -> dual 3*2=6
    # r=0.5, A=-1 -> max(0.5, 0.8) = 0.8 (clipped)
    assert loss[0].tolist() == pytest.approx([-1.3, -0.5, 1.3, 6.0, 0.8], rel=1e-6)
    assert clipped.tolist() == [[True, False, False, True, True]]


def test_settings_from_config_maps_names():
    s = settings_from_config(AlgoConfig(loss="triplet_clip", triplet_neg_high=0.5, dual_clip_c=2.0))
    assert s.bounds.neg_high == 0.5 and s.bounds.dual_clip_c == 2.0
    s = settings_from_config(AlgoConfig(loss="ppo_clip", clip_eps_low=0.1, clip_eps_high=0.3))
    assert (s.bounds.pos_low, s.bounds.pos_high, s.bounds.neg_low, s.bounds.dual_clip_c) == (0.1, 0.3, 0.1, 0.0)


def test_truncated_importance_sampling_weight():
    lp = torch.zeros(1, 2)
    trainer = torch.zeros(1, 2)
    rollout = torch.log(_t([0.25, 2.0]))  # exp(trainer - rollout) = 4 (capped to 2), 0.5
    s = LossSettings(tis_cap=2.0)
    out = policy_loss(lp, torch.zeros(1, 2), _t([1.0, 1.0]), torch.ones(1, 2), s,
                      rollout_logprobs=rollout, trainer_logprobs=trainer)
    # ratio 1 -> per token -A * w = [-2, -0.5]
    assert out.loss.item() == pytest.approx(-1.25, rel=1e-6)
    assert out.metric_sums["tis_weight"].item() == pytest.approx(2.5)
    diff = out.metric_sums["rollout_vs_trainer_logprob_diff"].item()
    assert diff == pytest.approx(math.log(4) + math.log(2), rel=1e-6)


def test_length_normalisations():
    lp = torch.zeros(2, 4)
    mask = _t([1, 1, 1, 1], [1, 1, 0, 0])
    adv = _t(1.0, 2.0)  # per-token loss -A: sample0 -1 x4, sample1 -2 x2
    tok = policy_loss(lp, lp, adv, mask, LossSettings(length_norm="token_mean"))
    assert (tok.loss_sum.item(), tok.denominator) == (-8.0, 6)
    seq = policy_loss(lp, lp, adv, mask, LossSettings(length_norm="seq_mean"))
    assert (seq.loss_sum.item(), seq.denominator) == (-3.0, 2)
    const = policy_loss(lp, lp, adv, mask, LossSettings(length_norm="constant", length_norm_constant=8))
    assert const.loss.item() == pytest.approx(-8.0 / 8 / 2)
    with pytest.raises(ValueError):
        policy_loss(lp, lp, adv, mask, LossSettings(length_norm="constant"))


def test_entropy_bonus():
    lp = torch.zeros(1, 1)
    ent = torch.full((1, 1), 3.0)
    out = policy_loss(lp, lp, _t(0.0), torch.ones(1, 1), LossSettings(entropy_coef=0.1), entropy=ent)
    assert out.loss.item() == pytest.approx(-0.3, rel=1e-6)
    assert out.metric_sums["entropy"].item() == 3.0
    plain = policy_loss(lp, lp, _t(0.0), torch.ones(1, 1), LossSettings(), entropy=ent)
    assert plain.loss.item() == 0.0 and plain.metric_sums["entropy"].item() == 3.0


def test_masked_tokens_do_not_count():
    lp = torch.log(_t([2.0, 2.0]))
    out = policy_loss(lp, torch.zeros(1, 2), _t(1.0), _t([0.0, 1.0]), LossSettings())
    assert out.num_tokens == 1
    assert out.loss.item() == pytest.approx(-1.2)


def test_logprob_diff_counts_only_on_policy_samples():
    lp = torch.zeros(2, 3)
    rollout = _t([0.1, 0.1, 0.1], [2.0, 2.0, 0.0])  # sample 1 is stale: its log-probs differ a lot
    mask = _t([1, 1, 1], [1, 1, 0])
    out = policy_loss(lp, rollout, _t(1.0, -1.0), mask, LossSettings(), rollout_logprobs=rollout,
                      on_policy=torch.tensor([True, False]))
    assert out.metric_sums["rollout_vs_trainer_logprob_diff"].item() == pytest.approx(0.3, rel=1e-6)
    assert out.metric_sums["on_policy_tokens"].item() == 3
    everything = policy_loss(lp, rollout, _t(1.0, -1.0), mask, LossSettings(), rollout_logprobs=rollout)
    assert everything.metric_sums["rollout_vs_trainer_logprob_diff"].item() == pytest.approx(4.3, rel=1e-6)
    assert everything.metric_sums["on_policy_tokens"].item() == 5
    # the loss itself does not depend on the on-policy mask
    assert out.loss.item() == pytest.approx(everything.loss.item())
