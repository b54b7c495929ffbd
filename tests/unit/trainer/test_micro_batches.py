import pytest
import torch

from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.config.base import ConfigError
from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.trainer.worker import build_micro_batches


def test_targets_mask_and_logprobs_are_shifted_to_predicting_position():
    samples = [TrainSample([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3]), TrainSample([1], [2], [-1.0])]
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
        build_micro_batches([TrainSample([1, 2], [3])], indices=[0], micro_batch_size=1,
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


def test_on_policy_rows_follow_the_current_version():
    samples = [TrainSample([1, 2], [3], version=v) for v in (5, 4, 5)]
    (mb,) = build_micro_batches(samples, indices=[0, 1, 2], micro_batch_size=4, num_micro_batches=1, seq_len=4,
                                current_version=5)
    assert mb.on_policy.tolist() == [True, False, True, False]  # last row is filler
    (mb,) = build_micro_batches(samples, indices=[0, 1, 2], micro_batch_size=3, num_micro_batches=1, seq_len=4)
    assert mb.on_policy.tolist() == [True, True, True]


def test_a_trajectorys_environment_tokens_are_context_not_loss_nor_parity():
    """A multi-turn sample's ``loss_mask`` (0 on tool tokens) reaches the micro-batch: the tool
    tokens are inputs, but neither the loss nor the engine/trainer log-prob metric sees them, however
    wrong the log-probs recorded there are."""
    from dora_megatron.algo.losses import LossSettings, policy_loss

    def sample(env_logprob):
        return TrainSample([5, 6], [7, 8, 40, 41, 9], [-0.1, -0.2, env_logprob, env_logprob, -0.3],
                           loss_mask=[1, 1, 0, 0, 1])

    mb = build_micro_batches([sample(0.0)], indices=[0], micro_batch_size=1, num_micro_batches=1, seq_len=7)[0]
    assert mb.tokens[0].tolist() == [5, 6, 7, 8, 40, 41, 9]  # tool tokens stay in the context
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 0]  # position t predicts token t+1
    logprobs = torch.full((1, 7), -0.5, requires_grad=True)
    outs = []
    for env_lp in (0.0, -30.0):
        mb = build_micro_batches([sample(env_lp)], indices=[0], micro_batch_size=1, num_micro_batches=1,
                                 seq_len=7, advantages=torch.tensor([1.0]))[0]
        outs.append(policy_loss(logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask, LossSettings(),
                                rollout_logprobs=mb.rollout_logprobs))
    a, b = outs
    assert a.num_tokens == b.num_tokens == 3
    assert a.loss_sum.item() == b.loss_sum.item()
    assert a.metric_sums["rollout_vs_trainer_logprob_diff"].item() == pytest.approx(0.4 + 0.3 + 0.2)
    assert b.metric_sums["rollout_vs_trainer_logprob_diff"].item() == pytest.approx(0.4 + 0.3 + 0.2)
    # no gradient flows into the positions that predict tool tokens
    a.loss_sum.backward()
    assert logprobs.grad[0].tolist()[3:5] == [0.0, 0.0] and logprobs.grad[0, 1].item() != 0.0


def test_the_trainer_service_refuses_a_malformed_loss_mask_naming_the_sample():
    from dora_megatron.comm.train_sample import SampleError, decode_train

    good = {"prompt_ids": [1], "response_ids": [2, 3], "rollout_logprobs": [0.0, 0.0], "version": 0, "reward": 1.0,
            "group_id": "g"}
    (sample,) = decode_train({"step": 0, "samples": [{**good, "loss_mask": [1, 0]}]}).samples
    assert sample.loss_mask == [1, 0] and sample.group_id == "g"
    for mask, match in (([1], r"\.loss_mask must be a list of one 0/1 per response token"), ([1, 2], r"\.loss_mask holds 2"),
                        ([0, 0], r"\.loss_mask is all 0"), ([1.0, 0], r"\.loss_mask\[0\] must be an integer, got 1\.0")):
        with pytest.raises(SampleError, match=rf"samples\[1\]{match}"):
            decode_train({"step": 0, "samples": [good, {**good, "loss_mask": mask}]})


_GOOD = {"prompt_ids": [1], "response_ids": [2, 3], "rollout_logprobs": [0.0, -0.5], "version": 0, "reward": 1.0,
         "group_id": "g"}
_ENTRY = {"prompt_tokens": 1, "response_tokens": 2, "reward": 1.0, "group_id": "g", "version": 0}


@pytest.mark.parametrize("body, message", [
    ({"samples": [_GOOD]}, "missing field step"),
    ({"step": True, "samples": [_GOOD]}, "step must be an integer, got True"),
    ({"step": 0, "samples": [_GOOD, 5]}, "samples[1] must be a JSON object, got 5"),
    ({"step": 0, "samples": [{**_GOOD, "response_ids": [2, True]}]}, "samples[0].response_ids[1] must be an integer, got True"),
    ({"step": 0, "samples": [{**_GOOD, "prompt_ids": [[1]]}]}, "samples[0].prompt_ids[0] must be an integer, got [1]"),
    ({"step": 0, "samples": [{**_GOOD, "reward": "high"}]}, "samples[0].reward must be a number, got 'high'"),
    ({"step": 0, "samples": []}, "'samples' must be a non-empty list"),
    ({"step": 0, "batch": None}, "'samples' must be a non-empty list"),
    ({"step": 0, "batch": [1]}, "batch must be a JSON object, got [1]"),
    # a batch directory's entry: typed too, the sample named by its index
    ({"step": 0, "batch": {"samples": [_ENTRY]}}, "missing field batch.dir"),
    ({"step": 0, "batch": {"dir": "/run/b", "samples": [_ENTRY, {**_ENTRY, "response_tokens": -2}]}},
     "batch.samples[1].response_tokens must be >= 0, got -2"),
    ({"step": 0, "batch": {"dir": "/run/b", "samples": [_ENTRY, {**_ENTRY, "prompt_tokens": False}]}},
     "batch.samples[1].prompt_tokens must be an integer, got False"),
    ({"step": 0, "batch": {"dir": "/run/b", "samples": [{**_ENTRY, "routed_ids": 4, "routed_at": ["routed_000000.bin", 0, 8]}]}},
     "batch.samples[0].routed_at[2] must be a string, got 8"),
    ({"step": 0, "batch": {"dir": "/run/b", "samples": [{**_ENTRY, "routed_ids": 4, "routed_at": {"file": "routed_000000.bin"}}]}},
     "batch.samples[0].routed_at must be a list, got {'file': 'routed_000000.bin'}"),
])
def test_a_malformed_train_body_names_the_field_and_value(body, message):
    from dora_megatron.comm.train_sample import SampleError, decode_train

    with pytest.raises(SampleError) as e:
        decode_train(body)
    assert str(e.value) == message


def test_a_train_body_decodes_to_the_same_records():
    from dora_megatron.comm.train_sample import (BatchEntry, BatchSample, SampleError, TrainRequest, TrainSample,
                                                 decode_train)

    req = decode_train({"step": 4, "samples": [_GOOD, {**_GOOD, "advantage": 0.5, "loss_mask": [1, 0]}]})
    assert req.step == 4 and req.batch is None
    assert req.samples == [TrainSample(**_GOOD), TrainSample(**{**_GOOD, "advantage": 0.5, "loss_mask": [1, 0]})]
    entry = {"dir": "/run/batches/4", "samples": [_ENTRY, {**_ENTRY, "advantage": 0.5, "routed_ids": 6}]}
    with pytest.raises(SampleError, match=r"batch: samples\[0\] has no routed_ids and samples\[1\] has"):
        decode_train({"step": 4, "batch": entry})
    entry["samples"][0] = {**_ENTRY, "routed_ids": 3, "routed_at": ["routed_000002.bin", 12, "int16"]}
    # the entry typed (its files are BatchReader's to check)
    assert decode_train({"step": 4, "batch": entry}) == TrainRequest(4, batch=BatchEntry("/run/batches/4", [
        BatchSample(1, 2, routed_ids=3, routed_at=("routed_000002.bin", 12, "int16"), reward=1.0, group_id="g",
                    version=0),
        BatchSample(1, 2, routed_ids=6, reward=1.0, group_id="g", version=0, advantage=0.5)]))
