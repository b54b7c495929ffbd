"""Request validation names the offending field; round trips keep SGLang field names."""

from __future__ import annotations

import pytest

from dora_megatron.comm import protocol as P


@pytest.mark.parametrize(
    "body,needle",
    [
        ([1, 2], "JSON object"),
        ({}, "missing field input_ids"),
        ({"input_ids": "abc"}, "input_ids must be a list, got 'abc'"),
        ({"input_ids": [1, 2.5]}, "input_ids[1] must be an integer, got 2.5"),
        ({"input_ids": []}, "must not be empty"),
        ({"input_ids": [[1], [2]]}, "batched"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature must be a number"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "ignore_eos must be a boolean"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be a boolean"),
        ({"input_ids": [1], "rid": 5}, "rid must be a string"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}},
         "sampling_params.temperature must be a finite number, got nan"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [3, True]}},
         "sampling_params.stop_token_ids[1] must be an integer, got True"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 1 << 70}}, "sampling_seed must be >= "),
        ({"input_ids": [1], "routed_experts_start_len": -2}, "routed_experts_start_len must be >= 0, got -2"),
    ],
)
def test_generate_validation(body, needle):
    with pytest.raises(P.ProtocolError) as e:
        P.GenerateRequest.from_json(body)
    assert needle in e.value.message and e.value.status == 400


def test_generate_roundtrip_and_defaults():
    g = P.GenerateRequest.from_json(
        {"input_ids": [3, 4], "rid": "a", "return_logprob": True, "dora_version": 2,
         "sampling_params": {"temperature": 0, "max_new_tokens": 5, "sampling_seed": 9}}
    )
    assert g.sampling_params.greedy and g.dora_version == "2"
    again = P.GenerateRequest.from_json(g.to_json())
    assert again == g
    assert P.SamplingParams.from_json(None).max_new_tokens == P.DEFAULT_MAX_NEW_TOKENS


def test_admin_request_validation():
    with pytest.raises(P.ProtocolError, match="rid"):
        P.AbortRequest.from_json({})
    assert P.AbortRequest.from_json({"abort_all": True}).abort_all
    with pytest.raises(P.ProtocolError, match="mode"):
        P.PauseRequest.from_json({"mode": "nap"})
    with pytest.raises(P.ProtocolError, match="model_path"):
        P.UpdateFromDiskRequest.from_json({})
    with pytest.raises(P.ProtocolError, match="differ in length"):
        P.UpdateFromDistributedRequest.from_json({"names": ["a"], "dtypes": [], "shapes": [[1]]})
    with pytest.raises(P.ProtocolError, match=r"shapes\[0\]\[1\] must be >= 0, got -2"):
        P.UpdateFromDistributedRequest.from_json({"names": ["a"], "dtypes": ["float32"], "shapes": [[1, -2]]})
    with pytest.raises(P.ProtocolError, match="master_port must be <= 65535, got 70000"):
        P.InitGroupRequest.from_json({"master_address": "x", "master_port": 70000, "rank_offset": 1, "world_size": 2})
    with pytest.raises(P.ProtocolError, match="master_port"):
        P.InitGroupRequest.from_json({"master_address": "x", "rank_offset": 1, "world_size": 2})
    with pytest.raises(P.ProtocolError, match="rank_offset"):
        P.InitGroupRequest.from_json({"master_address": "x", "master_port": 5, "rank_offset": 2, "world_size": 2})


def test_response_parsing():
    r = P.GenerateResponse.from_json(
        {"output_ids": [5, 6], "meta_info": {"id": "q", "finish_reason": {"type": "length", "length": 2},
         "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "1",
         "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}
    )
    assert r.finish_type == "length" and r.output_token_logprobs == [-0.5, -1.5] and not r.migrated
