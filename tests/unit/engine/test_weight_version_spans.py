"""``meta_info.weight_versions`` of the embedded engine: the spans SGLang (>= 0.5.22) reports
(``sglang/srt/utils/weight_versions.py``), which the runtime reads for its C1 accounting."""

from __future__ import annotations

from dora_megatron.rollout.engine.scheduler import weight_version_spans


def _t(spans):
    return [(s["version"], s["start"], s["end"]) for s in spans]


def test_an_update_in_the_middle_splits_the_output():
    assert _t(weight_version_spans([("0", 3)], "1", 5)) == [("0", 0, 3), ("1", 3, 5)]


def test_no_update_one_span_even_without_output():
    assert _t(weight_version_spans([], "4", 7)) == [("4", 0, 7)]
    assert _t(weight_version_spans([], "4", 0)) == [("4", 0, 0)]


def test_an_update_after_the_last_token_adds_no_span_and_repeated_versions_merge():
    assert _t(weight_version_spans([("0", 5)], "1", 5)) == [("0", 0, 5)]
    assert _t(weight_version_spans([("0", 2), ("1", 4), ("1", 6)], "2", 9)) == [("0", 0, 2), ("1", 2, 6), ("2", 6, 9)]
