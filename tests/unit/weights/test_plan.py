"""Bucket plans: order, sizes, every tensor exactly once, determinism (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_megatron.weights.plan import MB, TensorSpec, dtype_bytes, plan_buckets

DTYPES = ("float32", "bfloat16", "float16", "int64", "int8")

specs_strategy = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 700), min_size=0, max_size=3)),
    min_size=0, max_size=40,
).map(lambda xs: [TensorSpec(f"t{i}", d, tuple(s)) for i, (d, s) in enumerate(xs)])


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, bucket_mb=st.sampled_from([0.001, 0.01, 0.1, 0.5, 2.0]))
def test_plan_invariants(specs, bucket_mb):
    limit = int(bucket_mb * MB)
    buckets = plan_buckets(specs, bucket_mb)
    flat = [s for b in buckets for s in b.specs]
    assert flat == specs  # every tensor exactly once, original order
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.specs, "no empty buckets"
        assert b.nbytes <= limit or len(b.specs) == 1  # only a lone oversized tensor may exceed
    for a, b in zip(buckets, buckets[1:]):
        assert a.nbytes + b.specs[0].nbytes > limit  # greedy: the next tensor did not fit
    assert plan_buckets(list(specs), bucket_mb) == buckets  # deterministic


def test_sizes_and_oversized_tensor_alone():
    # 1 MiB limit; float32 256x256 = 256 KiB each
    small = [TensorSpec(f"s{i}", "float32", (256, 256)) for i in range(5)]
    big = TensorSpec("big", "float32", (1024, 1024))  # 4 MiB > limit
    buckets = plan_buckets(small[:3] + [big] + small[3:], 1)
    assert [b.names for b in buckets] == [["s0", "s1", "s2"], ["big"], ["s3", "s4"]]
    assert [b.nbytes for b in buckets] == [3 * 256 * 1024, 4 * MB, 2 * 256 * 1024]
    assert buckets[0].shapes == [[256, 256]] * 3 and buckets[0].dtypes == ["float32"] * 3


def test_exact_fit_and_tuples_and_torch_dtypes():
    import torch

    specs = [("a", torch.float32, [512, 256]), ("b", "torch.bfloat16", (512, 512)), ("c", "float32", (1,))]
    buckets = plan_buckets(specs, 1)  # a=512K, b=512K: exactly 1 MiB together
    assert [b.names for b in buckets] == [["a", "b"], ["c"]]
    assert buckets[0].dtypes == ["float32", "bfloat16"]


def test_errors():
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([TensorSpec("a", "float32", (1,))] * 2, 1)
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets([], 0)
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float128")
    assert plan_buckets([], 1) == []


def test_tensors_that_load_together_are_never_split_over_buckets():
    """``together``: a pair whose second tensor would not fit the current bucket moves to the next
    one whole (without it, a 1-tensor-per-bucket limit splits it); a key whose tensors are not
    consecutive is refused, since no order-preserving plan could keep it whole."""
    pair = {"q": "qa+kva", "kv": "qa+kva"}
    specs = [TensorSpec(n, "float32", (256, 256)) for n in ("a", "q", "kv", "b")]  # 256 KiB each
    assert [b.names for b in plan_buckets(specs, 0.5)] == [["a", "q"], ["kv", "b"]]
    assert [b.names for b in plan_buckets(specs, 0.5, pair.get)] == [["a"], ["q", "kv"], ["b"]]
    assert [b.names for b in plan_buckets(specs, 1e-9, pair.get)] == [["a"], ["q", "kv"], ["b"]]  # oversized: alone
    with pytest.raises(ValueError, match="'kv' loads together with others"):
        plan_buckets([specs[1], specs[0], specs[2]], 1, pair.get)
