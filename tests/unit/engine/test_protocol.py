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


# ---- wire values decoded by msgspec: each refusal is a 400 naming the field path and the value ----------


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [1, True]}, "input_ids[1] must be an integer, got True"),
    ({"input_ids": [1, [2]]}, "input_ids[1] must be an integer, got [2]"),
    ({"input_ids": None}, "input_ids must be a list, got None"),
    ({"input_ids": [1], "dora_draft_sources": [[1], [2, 3.5]]}, "dora_draft_sources[1][1] must be an integer, got 3.5"),
    ({"input_ids": [1], "dora_draft_sources": [[1, [2]]]}, "dora_draft_sources[0][1] must be an integer, got [2]"),
    ({"input_ids": [1], "dora_draft_sources": [[1], None]}, "dora_draft_sources[1] must be a list, got None"),
    ({"input_ids": [1], "dora_draft_sources": {"a": [1]}}, "dora_draft_sources must be a list, got {'a': [1]}"),
    ({"input_ids": [1], "dora_version": {"v": 1}}, "dora_version must be a string or an integer, got {'v': 1}"),
    ({"input_ids": [1], "dora_version": True}, "dora_version must be a string or an integer, got True"),
    ({"input_ids": [1], "dora_version": 2.0}, "dora_version must be a string or an integer, got 2.0"),
])
def test_a_wrong_wire_value_is_named_with_its_path(body, message):
    with pytest.raises(P.ProtocolError) as e:
        P.GenerateRequest.from_json(body)
    assert e.value.status == 400 and e.value.message == message


def test_valid_wire_values_decode_to_the_same_request():
    ids = list(range(30_000))  # a long prompt: checked and copied by msgspec in one pass
    g = P.GenerateRequest.from_json({"input_ids": ids, "dora_version": 7, "dora_draft_sources": None,
                                     "dora_keep_kv": True})
    assert g.input_ids == ids and all(type(t) is int for t in g.input_ids)
    assert g.dora_version == "7" and g.dora_draft_sources == [] and g.dora_keep_kv
    assert P.GenerateRequest.from_json({"input_ids": [1], "dora_version": "v2"}).dora_version == "v2"


@pytest.mark.parametrize("cls, body, message", [
    (P.UpdateFromDiskRequest, {"model_path": "/m", "weight_version": {"v": 1}},
     "weight_version must be a string or an integer, got {'v': 1}"),
    (P.UpdateFromDistributedRequest, {"names": [], "dtypes": [], "shapes": [], "weight_version": [3]},
     "weight_version must be a string or an integer, got [3]"),
    (P.DraftSourcesRequest, {"rid": "a", "sources": [[1], [2.5]]}, "sources[1][0] must be an integer, got 2.5"),
    (P.DraftSourcesRequest, {"rid": "a", "sources": [[1], "ab"]}, "sources[1] must be a list, got 'ab'"),
    (P.DraftSourcesRequest, {"rid": "a", "sources": 5}, "sources must be a list, got 5"),
])
def test_admin_wire_values_are_named_with_their_path(cls, body, message):
    with pytest.raises(P.ProtocolError) as e:
        cls.from_json(body)
    assert e.value.status == 400 and e.value.message == message


def test_admin_version_labels_and_absent_sources_decode_as_before():
    assert P.UpdateFromDiskRequest.from_json({"model_path": "/m", "weight_version": 4}).weight_version == "4"
    assert P.UpdateFromDiskRequest.from_json({"model_path": "/m"}).weight_version is None
    assert P.DraftSourcesRequest.from_json({"rid": "a"}).sources == []
    assert P.DraftSourcesRequest.from_json({"rid": "a", "sources": None}).sources == []
    assert P.DraftSourcesRequest.from_json({"rid": "a", "sources": [[1, 2]]}).sources == [[1, 2]]


@pytest.mark.parametrize("cls, what", [
    (P.GenerateRequest, "/generate"), (P.AbortRequest, "/abort_request"), (P.PauseRequest, "/pause_generation"),
    (P.UpdateFromDiskRequest, "/update_weights_from_disk"), (P.DraftSourcesRequest, "/dora/draft_sources"),
    (P.ExportRequest, "/dora/export_request"),
])
def test_a_body_that_is_no_object_is_named(cls, what):
    with pytest.raises(P.ProtocolError) as e:
        cls.from_json([1, 2])
    assert e.value.status == 400 and e.value.message == f"{what}: request body must be a JSON object, got list"


@pytest.mark.parametrize("spans, message", [
    ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": "2", "end": 3}],
     "meta_info.weight_versions[1].start must be an integer, got '2'"),
    ([{"start": 0, "end": 2}], "missing field meta_info.weight_versions[0].version"),
    ([["1", 0, 2]], "meta_info.weight_versions[0] must be a JSON object, got ['1', 0, 2]"),
    ([{"version": {"v": 1}}], "meta_info.weight_versions[0].version must be a string or an integer, got {'v': 1}"),
    ({"version": "1"}, "meta_info.weight_versions must be a list, got {'version': '1'}"),
])
def test_a_malformed_weight_version_span_is_refused_not_skipped(spans, message):
    """A span the runtime cannot read would drop a version from the check of which weights sampled
    the answer: it is an error (formerly skipped)."""
    with pytest.raises(P.ProtocolError) as e:
        P.GenerateResponse.from_json({"meta_info": {"weight_versions": spans}})
    assert e.value.status == 400 and e.value.message == message


def test_weight_version_spans_decode_as_before():
    def spans(raw):
        return P.GenerateResponse.from_json({"meta_info": {"weight_versions": raw}}).weight_versions

    assert spans([{"version": "1", "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 5}]) == [("1", 0, 2),
                                                                                                   ("2", 2, 5)]
    assert spans([{"version": "3"}]) == [("3", 0, 0)] and spans(None) == [] and spans([]) == []
