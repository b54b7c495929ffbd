"""A sample's arrays written by ``array_json`` (journal lines, ``controller.json``) read back as the
same values ``json.dumps`` of their lists gives, NaN and infinities included."""

from __future__ import annotations

import json
import math
import random
from array import array

from dora_megatron.controller.array_text import array_json
from dora_megatron.controller.journal import Journal, JournaledSample, read_journal


def test_floats_and_ints_read_back_as_the_same_values():
    rng = random.Random(3)
    lps = array("f", [-rng.expovariate(4.0) for _ in range(2000)] + [-3.2e-07, -1e-05, 0.0, -0.0, -1e30, -7.5])
    ids = array("i", [rng.randrange(-2**31, 2**31) for _ in range(500)] + [0, 2**31 - 1, -2**31])
    for values in (lps, ids, array("d", [1e-300, -2.5e16, 0.1])):
        got = json.loads(array_json(values))
        assert got == values.tolist()
        assert [math.copysign(1, x) for x in got] == [math.copysign(1, x) for x in values.tolist()]
    assert array_json(array("f")) == b"[]"


def test_nan_and_infinities_are_kept_not_nulled():
    values = array("f", [-0.5, float("-inf"), float("nan"), float("inf")])
    text = array_json(values)
    assert text == json.dumps(values.tolist()).encode()
    got = json.loads(text)
    assert got[:2] == [-0.5, float("-inf")] and math.isnan(got[2]) and got[3] == float("inf")


def test_a_journaled_sample_with_an_infinite_logprob_is_restored_whole(tmp_path):
    journal = Journal(tmp_path)
    journal.start(2)
    lps = array("f", [-0.25, float("-inf"), -1e-06])
    journal.sample(JournaledSample("g0.0", "g0", 2, 0, array("i", [5, 6, 7]), lps, 1.0, finish_reason="stop"), [2])
    journal.close()
    [(sid, back)] = read_journal(tmp_path, 2).items()
    assert sid == "g0.0" and back.response_ids == (5, 6, 7) and back.finish_reason == "stop"
    assert array("f", back.rollout_logprobs) == lps
