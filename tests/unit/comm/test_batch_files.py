"""The columnar batch hand-off (dora_megatron.comm.batch_files): round trip, the routed experts'
dtype, errors that name the field, and each data-parallel rank reading exactly its own samples."""

from __future__ import annotations

import base64
from array import array

import numpy as np
import pytest

from dora_megatron.comm.batch_files import BatchFileError, BatchReader, compact_routed, expert_dtype, write_batch
from dora_megatron.comm.train_sample import TrainSample, routed_text
from dora_megatron.trainer.packing import plan_step


def _routed(positions: int, layers: int, top_k: int, top: int, seed: int) -> str:
    ids = np.random.default_rng(seed).integers(0, top + 1, size=positions * layers * top_k).astype("<i4")
    return base64.b64encode(ids.tobytes()).decode()


def _samples(n: int = 6, routed_top: int | None = None) -> list[TrainSample]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        p, r = 3 + i, 5 + 2 * i
        s = TrainSample([100 + i] * p if i % 2 else array("i", range(p)),
                        array("i", rng.integers(0, 50_000, r).tolist()), array("f", (-rng.random(r)).tolist()),
                        reward=float(i % 3), group_id=f"g{i // 2}", version=i // 3)
        if i == 2:
            s.loss_mask = [1, 0] * (r // 2) + [1] * (r % 2)
        if routed_top is not None:
            s.routed_experts = _routed(p + r - 1, 3, 2, routed_top, i)
        out.append(s)
    return out


def test_round_trip_keeps_every_field_in_compact_dtypes(tmp_path):
    samples = _samples(routed_top=60)
    entry = write_batch(tmp_path / "step_000001", samples)
    assert not (tmp_path / "step_000001.tmp").exists()
    reader = BatchReader(entry)
    got = reader.samples(range(len(samples)))
    for s, g in zip(samples, got):
        assert g.prompt_ids.dtype == np.int32 and g.response_ids.dtype == np.int32
        assert g.rollout_logprobs.dtype == np.float32
        assert g.prompt_ids.tolist() == list(s.prompt_ids)
        assert g.response_ids.tolist() == list(s.response_ids)
        assert g.rollout_logprobs.tolist() == list(s.rollout_logprobs)
        assert (g.reward, g.group_id, g.version) == (s.reward, s.group_id, s.version)
        want_routed = np.frombuffer(base64.b64decode(s.routed_experts), "<i4")
        assert g.routed_experts.dtype == np.int8 and g.routed_experts.tolist() == want_routed.tolist()
        assert (g.loss_mask.tolist() if g.loss_mask is not None else None) == s.loss_mask


def test_expert_dtype_is_the_smallest_that_holds_the_count_and_minus_one():
    assert expert_dtype(8) == np.int8 and expert_dtype(128) == np.int8
    assert expert_dtype(129) == np.int16 and expert_dtype(32768) == np.int16
    assert expert_dtype(32769) == np.int32


def test_batch_of_more_than_127_experts_is_written_as_int16(tmp_path):
    entry = write_batch(tmp_path / "b", _samples(routed_top=200))
    assert np.load(tmp_path / "b" / "routed_experts.npy").dtype == np.int16
    assert BatchReader(entry).samples([0])[0].routed_experts.max() <= 200


def test_compact_routed_round_trips_through_sglangs_text():
    text = _routed(7, 4, 2, 300, 0)
    arr = compact_routed(text)
    assert arr.dtype == np.int16
    assert routed_text(arr) == text
    assert compact_routed(None) is None and compact_routed([[1, -1]]).dtype == np.int8


def test_malformed_entries_name_the_field_at_fault(tmp_path):
    entry = write_batch(tmp_path / "b", _samples())
    bad = {**entry, "samples": [dict(s) for s in entry["samples"]]}
    del bad["samples"][1]["response_tokens"]
    with pytest.raises(BatchFileError, match=r"batch\.samples\[1\]\.response_tokens"):
        BatchReader(bad)
    longer = {**entry, "samples": [dict(s) for s in entry["samples"]]}
    longer["samples"][0]["prompt_tokens"] += 1  # the files hold one token less than the entry says
    with pytest.raises(BatchFileError, match=r"prompt_ids\.npy"):
        BatchReader(longer)
    with pytest.raises(BatchFileError, match=r"batch\.dir .*cannot read"):
        BatchReader({**entry, "dir": str(tmp_path / "missing")})
    with pytest.raises(BatchFileError, match=r"samples\[0\]: rollout_logprobs \(2\) and response_ids \(3\)"):
        write_batch(tmp_path / "c", [TrainSample([1], [1, 2, 3], [0.0, 0.0], reward=1.0, group_id="g")])
    with pytest.raises(BatchFileError, match=r"samples\[0\]\.response_ids holds"):
        write_batch(tmp_path / "d", [TrainSample([1], [1.5], [0.0], reward=1.0, group_id="g")])
    with pytest.raises(BatchFileError, match="routed_experts is not base64"):
        write_batch(tmp_path / "e", [TrainSample([1], [1], [0.0], reward=1.0, group_id="g", routed_experts="not base64!")])


@pytest.mark.parametrize("max_tokens", [0, 40])
def test_each_dp_rank_reads_exactly_its_planned_samples_once(tmp_path, max_tokens):
    samples = _samples(n=11, routed_top=7)
    entry = write_batch(tmp_path / "b", samples)
    lengths = [s.tokens() for s in samples]
    dp, seen, read = 3, [], []
    for rank in range(dp):
        plan = plan_step(lengths, dp=dp, dp_rank=rank, micro_batch_size=2, max_tokens=max_tokens)
        rows = sorted({i for mb in plan.micro_batches for i in mb.rows if i >= 0})
        reader = BatchReader(entry)
        got = reader.samples(rows)
        assert len(got) == len(samples)  # every sample's lengths (the plan), only its rows' data
        for i in rows:
            assert got[i].response_ids.tolist() == list(samples[i].response_ids)
        # int32 ids of prompt and response, a float32 log-prob and (sample 2 only) a mask byte per
        # response token, 3 layers x top-2 int8 routed ids per position
        want = sum(4 * lengths[i] + 4 * len(samples[i].response_ids) + 6 * (lengths[i] - 1)
                   + (len(samples[i].response_ids) if i == 2 else 0) for i in rows)
        assert reader.bytes_read == want
        seen += rows
        read.append(reader.bytes_read)
    assert sorted(seen) == list(range(len(samples)))  # every sample on exactly one rank
    payload = sum(np.load(f, mmap_mode="r").nbytes for f in (tmp_path / "b").glob("*.npy"))
    unmasked = sum(len(s.response_ids) for i, s in enumerate(samples) if i != 2)  # mask ones nobody reads
    assert sum(read) == payload - unmasked


def test_arrays_are_written_as_they_are_and_lists_give_the_same_files(tmp_path):
    """The store's int32/float32 arrays go to the files without numpy (and the columns in parallel
    threads): the bytes are those of the same samples given as lists."""
    samples = _samples(routed_top=60)
    as_lists = [TrainSample(**{k: (v.tolist() if isinstance(v, array) else v) for k, v in vars(s).items()})
                for s in samples]
    write_batch(tmp_path / "a", samples)
    write_batch(tmp_path / "l", as_lists)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["loss_mask.npy", "prompt_ids.npy", "response_ids.npy", "rollout_logprobs.npy", "routed_experts.npy"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "l" / name).read_bytes(), name


def test_the_bulk_check_of_an_entry_agrees_with_the_per_sample_one(tmp_path):
    """A rank checks a well-formed entry in bulk; anything the bulk check does not vouch for (a bool
    reward, a negative count) goes through the per-sample checks, which accept or name it as before."""
    from dora_megatron.comm.batch_files import _checked_counts, _fast_counts

    entry = write_batch(tmp_path / "b", _samples(routed_top=60))
    assert _fast_counts(entry["samples"]) == _checked_counts(entry["samples"])
    odd = [dict(s) for s in entry["samples"]]
    odd[1]["reward"] = True  # a bool is a number to the per-sample check
    assert _fast_counts(odd) is None and _checked_counts(odd) == _checked_counts(entry["samples"])
    odd[3]["prompt_tokens"] = -1
    assert _fast_counts(odd) is None
    with pytest.raises(BatchFileError, match=r"batch.samples\[3\].prompt_tokens"):
        BatchReader({"dir": entry["dir"], "samples": odd})
