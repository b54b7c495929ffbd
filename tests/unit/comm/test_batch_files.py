"""The columnar batch hand-off (dora_megatron.comm.batch_files): round trip, the routed experts'
dtype, errors that name the field, and each data-parallel rank reading exactly its own samples."""

from __future__ import annotations

import base64
from array import array

import numpy as np
import pytest

from dora_megatron.comm.batch_files import (BatchFileError, BatchReader, compact_routed, decode_batch, expert_dtype,
                                             write_batch)
from dora_megatron.comm.train_sample import BatchEntry, BatchSample, TrainSample, routed_text
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
    reader = BatchReader(decode_batch(entry))
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
    assert BatchReader(decode_batch(entry)).samples([0])[0].routed_experts.max() <= 200


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
        decode_batch(bad)
    longer = {**entry, "samples": [dict(s) for s in entry["samples"]]}
    longer["samples"][0]["prompt_tokens"] += 1  # the files hold one token less than the entry says
    with pytest.raises(BatchFileError, match=r"prompt_ids\.npy"):
        BatchReader(decode_batch(longer))
    with pytest.raises(BatchFileError, match=r"batch\.dir .*cannot read"):
        BatchReader(decode_batch({**entry, "dir": str(tmp_path / "missing")}))
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
        reader = BatchReader(decode_batch(entry))
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


def test_an_entry_decodes_to_typed_samples_with_the_fields_write_batch_gave(tmp_path):
    """What the controller writes is what a rank decodes: every field of each sample's entry lands
    in the typed record (a field write_batch adds and the struct lacks would be dropped here)."""
    samples = _samples(routed_top=60)
    samples[1].advantage = 0.25
    entry = write_batch(tmp_path / "b", samples)
    decoded = decode_batch(entry)
    assert decoded.dir == str(tmp_path / "b")
    for s, d, raw in zip(samples, decoded.samples, entry["samples"]):
        assert set(raw) <= set(BatchSample.__struct_fields__)
        assert (d.prompt_tokens, d.response_tokens) == (len(s.prompt_ids), len(s.response_ids))
        assert (d.reward, d.group_id, d.version, d.advantage) == (s.reward, s.group_id, s.version, s.advantage)
        assert d.loss_mask is (s.loss_mask is not None) and d.routed_ids == raw["routed_ids"]
    assert decoded.lengths() == [s.tokens() for s in samples]


_ENTRY = {"prompt_tokens": 3, "response_tokens": 2, "reward": 1.0, "group_id": "g", "version": 0}
_SPOOLED = {**_ENTRY, "routed_ids": 4, "routed_at": ["routed_000000.bin", 8, "int8"]}


@pytest.mark.parametrize("samples, extra, message", [
    ([_ENTRY, {**_ENTRY, "prompt_tokens": -1}], {}, "batch.samples[1].prompt_tokens must be >= 0, got -1"),
    ([_ENTRY, _ENTRY, {**_ENTRY, "response_tokens": True}], {}, "batch.samples[2].response_tokens must be an integer, got True"),
    ([_ENTRY, {**_ENTRY, "prompt_tokens": 2.0}], {}, "batch.samples[1].prompt_tokens must be an integer, got 2.0"),
    ([{**_ENTRY, "response_tokens": 0}], {}, "batch.samples[0]: response_tokens is 0 (no token to train on), got "),
    ([_ENTRY, {k: v for k, v in _ENTRY.items() if k != "response_tokens"}], {}, "missing field batch.samples[1].response_tokens"),
    ([_ENTRY, {**_ENTRY, "reward": True}], {}, "batch.samples[1].reward must be a number, got True"),
    ([_ENTRY, {**_ENTRY, "reward": None}], {}, "batch.samples[1]: needs a numeric 'advantage', or 'reward' with 'group_id'"),
    ([_ENTRY, {**_ENTRY, "group_id": [1]}], {}, "batch.samples[1].group_id must be a string or an integer, got [1]"),
    ([_ENTRY, 7], {}, "batch.samples[1] must be a JSON object, got 7"),
    ([_SPOOLED, {**_SPOOLED, "routed_at": "routed_000000.bin"}], {}, "batch.samples[1].routed_at must be a list, got 'routed_000000.bin'"),
    ([_SPOOLED, {**_SPOOLED, "routed_at": ["routed_000000.bin", "8", "int8"]}], {},
     "batch.samples[1].routed_at[1] must be an integer, got '8'"),
    ([_SPOOLED, {**_SPOOLED, "routed_at": ["routed_000000.bin/../x", 8, "int8"]}], {},
     "batch.samples[1].routed_at[0] must be a string matching"),
    ([_SPOOLED, {**_SPOOLED, "routed_ids": -4}], {}, "batch.samples[1].routed_ids must be >= 0, got -4"),
    ([_SPOOLED, {k: v for k, v in _SPOOLED.items() if k != "routed_ids"}], {},
     "batch.samples[1]: routed_at needs routed_ids"),
    ([_SPOOLED, _ENTRY], {}, "batch: samples[1] has no routed_ids and samples[0] has"),
    ([], {}, "batch.samples must be a list of length >= 1, got []"),
    ([_ENTRY], {"dir": None}, "batch.dir must be a string, got None"),
    ([_ENTRY], {"dir": ""}, "batch.dir must be a string of length >= 1, got ''"),
])
def test_a_malformed_entry_is_refused_naming_the_field_the_sample_and_the_value(samples, extra, message):
    """The entry is untrusted JSON: its field types (msgspec) refuse what a rank cannot read,
    before any file is opened, naming the sample by its index, the field and the value."""
    with pytest.raises(BatchFileError) as e:
        decode_batch({"dir": "/run/batches/step_000000", "samples": samples, **extra})
    assert str(e.value).startswith(message), str(e.value)


def test_an_entry_without_its_directory_is_refused():
    with pytest.raises(BatchFileError) as e:
        decode_batch({"samples": [_ENTRY]})
    assert str(e.value) == "missing field batch.dir"
    with pytest.raises(BatchFileError) as e:
        decode_batch([_ENTRY])
    assert str(e.value).startswith("batch must be a JSON object, got [")


def test_the_typed_entry_pickles_as_the_ranks_receive_it(tmp_path):
    """Rank 0 broadcasts the decoded entry to the other ranks by pickle: they read the same files."""
    import pickle

    entry = write_batch(tmp_path / "b", _samples(routed_top=60))
    decoded = decode_batch(entry)
    again = pickle.loads(pickle.dumps(decoded))
    assert isinstance(again, BatchEntry) and again == decoded
    got = BatchReader(again).samples([3])[3]
    assert got.response_ids.tolist() == BatchReader(decoded).samples([3])[3].response_ids.tolist()
