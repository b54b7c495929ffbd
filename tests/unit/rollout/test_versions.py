"""The one C1 span rule both engine adapters use (:func:`dora_megatron.rollout.versions.span_problem`)."""

from __future__ import annotations

from dora_megatron.rollout.versions import span_problem

CROSSED = [("1", 0, 2), ("2", 2, 3)]  # started on the routed version 1, an update came mid-request
STALE_START = [("0", 0, 1), ("1", 1, 3)]  # its first token came from the previous weights


def test_sglang_case_keeps_an_answer_that_crossed_an_update_and_refuses_one_that_started_elsewhere():
    assert span_problem(CROSSED, 3, "1", updates_in_flight=True) is None
    assert span_problem(list(reversed(CROSSED)), 3, "1", updates_in_flight=True) is None  # spans in any order
    assert "started on weights '0', not '1'" in span_problem(STALE_START, 3, "1", updates_in_flight=True)
    # an SGLang without spans: the adapter passes the echoed version as the only span
    assert "started on weights '2'" in span_problem([("2", 0, 3)], 3, "1", updates_in_flight=True)
    # no output yet: the echoed version still decides (the runtime records it)
    assert span_problem([("2", 0, 0)], 0, "1", updates_in_flight=True) is not None
    assert span_problem([], 3, "1", updates_in_flight=True) == "no weight version reported"


def test_vllm_case_refuses_any_token_from_another_version_and_any_token_without_a_span():
    assert "tokens 2..3 were sampled by weights '2', not '1'" in span_problem(CROSSED, 3, "1", updates_in_flight=False)
    assert "tokens 0..1 were sampled by weights '0'" in span_problem(STALE_START, 3, "1", updates_in_flight=False)
    assert span_problem([], 0, "1", updates_in_flight=False) is None  # aborted before any token: nothing to count
    assert "without weight_versions spans" in span_problem([], 3, "1", updates_in_flight=False)
    assert "cover 2 of 3" in span_problem([("1", 0, 2)], 3, "1", updates_in_flight=False)
    assert "not contiguous" in span_problem([("1", 1, 3)], 3, "1", updates_in_flight=False)
    assert "not contiguous" in span_problem([("1", -1, -1)], 3, "1", updates_in_flight=False)  # a span without bounds
    assert span_problem([("1", 2, 3), ("1", 0, 2)], 3, "1", updates_in_flight=False) is None
