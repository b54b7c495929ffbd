import pytest
import torch

from dora_megatron.config.base import ConfigError
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.trainer.worker import build_micro_batches


def test_targets_mask_and_logprobs_are_shifted_to_predicting_position():
    samples = [{"prompt_ids": [5, 6], "response_ids": [7, 8, 9], "rollout_logprobs": [-0.1, -0.2, -0.3]},
               {"prompt_ids": [1], "response_ids": [2], "rollout_logprobs": [-1.0]}]
    mbs = build_micro_batches(samples, indices=[0, 1], micro_batch_size=2, num_micro_batches=2, seq_len=6,
                              advantages=torch.tensor([0.5, -1.0]))
    mb = mbs[0]
    assert mb.tokens[0].tolist() == [5, 6, 7, 8, 9, 0]
    assert mb.targets[0].tolist() == [6, 7, 8, 9, 0, 0]
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0]
    assert mb.rollout_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, 0])
    assert mb.loss_mask[1].tolist() == [1, 0, 0, 0, 0, 0]
    assert mb.advantages.tolist() == [0.5, -1.0]
    assert mb.attention_mask.shape == (1, 1, 6, 6) and mb.attention_mask[0, 0, 0, 1] and not mb.attention_mask[0, 0, 1, 0]
    # the second micro-batch is filler: nothing to learn from
    assert mbs[1].index == [-1, -1] and mbs[1].loss_mask.sum() == 0


def test_too_long_sample_is_rejected():
    with pytest.raises(ValueError):
        build_micro_batches([{"prompt_ids": [1, 2], "response_ids": [3]}], indices=[0], micro_batch_size=1,
                            num_micro_batches=1, seq_len=2)


def test_data_parallel_size_is_derived_and_checked():
    assert TrainerConfig(tp=2).data_parallel_size(4) == 2
    assert TrainerConfig(ep=2).data_parallel_size(2) == 2
    with pytest.raises(ConfigError):
        TrainerConfig(tp=2, pp=2).data_parallel_size(2)
    with pytest.raises(ConfigError):
        TrainerConfig(dp=3).data_parallel_size(2)
    with pytest.raises(ConfigError):
        TrainerConfig(ep=4).data_parallel_size(2)


def test_reference_logprobs_are_aligned_when_given():
    samples = [{"prompt_ids": [5], "response_ids": [7, 8], "ref_logprobs": [-0.5, -0.25]}]
    mb = build_micro_batches(samples, indices=[0], micro_batch_size=1, num_micro_batches=1, seq_len=4)[0]
    assert mb.ref_logprobs[0].tolist() == [-0.5, -0.25, 0, 0]
    plain = build_micro_batches([{"prompt_ids": [5], "response_ids": [7]}], indices=[0], micro_batch_size=1,
                                num_micro_batches=1, seq_len=4)[0]
    assert plain.ref_logprobs is None


def test_on_policy_rows_follow_the_current_version():
    samples = [{"prompt_ids": [1, 2], "response_ids": [3], "version": v} for v in (5, 4, 5)]
    (mb,) = build_micro_batches(samples, indices=[0, 1, 2], micro_batch_size=4, num_micro_batches=1, seq_len=4,
                                current_version=5)
    assert mb.on_policy.tolist() == [True, False, True, False]  # last row is filler
    (mb,) = build_micro_batches(samples, indices=[0, 1, 2], micro_batch_size=3, num_micro_batches=1, seq_len=4)
    assert mb.on_policy.tolist() == [True, True, True]
