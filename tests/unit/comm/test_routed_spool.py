"""Routed experts spooled as samples finish (dora_megatron.comm.routed_spool): a batch names where
they are instead of copying them, each rank reads back exactly the ids it trains, a bad
``routed_at`` is refused naming the sample, trained segments go, a failed write is raised."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import pytest

from dora_megatron.comm.batch_files import BatchFileError, BatchReader, decode_batch, write_batch
from dora_megatron.comm.routed_spool import SPOOL_DIR, RoutedSpool, SpooledRouted
from dora_megatron.comm.train_sample import TrainSample
from dora_megatron.trainer.packing import plan_step


def _routed(n_ids: int, experts: int, seed: int) -> np.ndarray:
    dtype = np.int8 if experts <= 127 else np.int16
    return np.random.default_rng(seed).integers(-1, experts, n_ids).astype(dtype)


def _sample(i: int, routed) -> TrainSample:
    return TrainSample(array("i", [1, 2, 3]), array("i", range(100, 100 + 2 + i)), array("f", [-0.5] * (2 + i)),
                       version=0, reward=float(i % 2), group_id=f"g{i // 2}", routed_experts=routed)


def test_spooled_and_in_memory_routed_experts_read_back_identically_by_each_rank(tmp_path):
    batches = tmp_path / "batches"
    spool = RoutedSpool(batches / SPOOL_DIR, segment_bytes=64)  # tiny segments: samples span several files
    want = [_routed((3 + 2 + i - 1) * 4, 300 if i % 3 == 0 else 60, i) for i in range(9)]
    # samples 2 and 5 were restored from a checkpoint (no spool entry): the batch copies theirs
    samples = [_sample(i, want[i] if i in (2, 5) else spool.put(want[i])) for i in range(9)]
    spool.flush()
    assert len(list((batches / SPOOL_DIR).glob("routed_*.bin"))) > 1
    entry = write_batch(batches / "step_000000", samples)
    assert [("routed_at" in s) for s in entry["samples"]] == [i not in (2, 5) for i in range(9)]
    in_file = np.load(batches / "step_000000" / "routed_experts.npy")
    assert in_file.size == want[2].size + want[5].size  # only the two not spooled were copied
    lengths = [s["prompt_tokens"] + s["response_tokens"] for s in entry["samples"]]
    seen: list[int] = []
    for rank in range(3):
        plan = plan_step(lengths, dp=3, dp_rank=rank, micro_batch_size=1, max_tokens=0)
        rows = sorted({i for mb in plan.micro_batches for i in mb.rows if i >= 0})
        reader = BatchReader(decode_batch(entry))
        got = reader.samples(rows)
        for i in rows:
            assert got[i].routed_experts.tolist() == want[i].tolist()
            assert got[i].routed_experts.dtype.itemsize == want[i].dtype.itemsize  # the spool keeps each dtype
        assert reader.bytes_read == sum(4 * 3 + 8 * (2 + i) + want[i].nbytes for i in rows)
        seen += rows
    assert sorted(seen) == list(range(9))
    spool.close()
    assert not (batches / SPOOL_DIR).exists()


@pytest.mark.parametrize("at, match", [
    (["../secret.bin", 0, "int8"], r"batch\.samples\[1\]\.routed_at\[0\] must be a string matching .*, got '\.\./secret\.bin'"),
    (["routed_000000.bin", -1, "int8"], r"batch\.samples\[1\]\.routed_at\[1\] must be >= 0, got -1"),
    (["routed_000000.bin", 0, "float32"], r"batch\.samples\[1\]\.routed_at\[2\] must be a string matching .*int8\|int16\|int32.*, "
                                          r"got 'float32'"),
    (["routed_000000.bin", 0], r"batch\.samples\[1\]\.routed_at must be a list of length 3"),
    (["routed_000000.bin", 10, "int8"], r"batch\.samples\[1\]\.routed_at: 16 int8 ids at byte 10 end past the 20"),
    (["routed_000009.bin", 0, "int8"], r"batch\.samples\[1\]\.routed_at: cannot read the spool segment"),
])
def test_a_bad_routed_at_is_refused_naming_the_sample(tmp_path, at, match):
    spool = RoutedSpool(tmp_path / SPOOL_DIR)
    samples = [_sample(0, spool.put(_routed(4, 8, 0))), _sample(1, spool.put(_routed(16, 8, 1)))]
    spool.flush()
    entry = write_batch(tmp_path / "step_000000", samples)
    assert entry["samples"][1]["routed_at"] == ["routed_000000.bin", 4, "int8"]
    BatchReader(decode_batch(entry)).samples([0, 1])  # as written: read
    entry["samples"][1]["routed_at"] = at
    with pytest.raises(BatchFileError, match=match):
        BatchReader(decode_batch(entry))  # the types refuse the first four, the reader the others
    spool.close()


def test_a_segment_goes_once_all_its_samples_were_trained_and_the_open_one_stays(tmp_path):
    spool = RoutedSpool(tmp_path, segment_bytes=10)
    refs = [spool.put(np.full(8, i, np.int8)) for i in range(3)]  # 8 bytes each: one segment per sample
    spool.flush()
    assert [r.file for r in refs] == ["routed_000000.bin", "routed_000001.bin", "routed_000002.bin"]
    spool.retire(refs[:1])  # trained, and no checkpoint names it: gone
    spool.flush()  # deletions are queued after the segment's writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routed_000001.bin", "routed_000002.bin"]
    spool.retire(refs[2:])  # the open segment: kept for the next samples
    assert (tmp_path / "routed_000002.bin").exists()
    nxt = spool.put(np.full(8, 7, np.int8))  # rotates: the emptied segment 2 goes
    spool.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routed_000001.bin", "routed_000003.bin"]
    assert np.fromfile(tmp_path / nxt.file, np.int8).tolist() == [7] * 8
    spool.close()


def test_a_failed_write_is_raised_by_flush(tmp_path):
    blocker = tmp_path / "spool"
    blocker.write_text("a file where the spool's directory should be")
    spool = RoutedSpool(blocker)
    spool.put(np.zeros(4, np.int8))
    with pytest.raises(OSError):
        spool.flush()
    spool.close()


def test_put_refuses_ids_that_are_not_a_compact_integer_type(tmp_path):
    spool = RoutedSpool(tmp_path)
    with pytest.raises(ValueError, match="float32 ids"):
        spool.put(np.zeros(4, np.float32))
    assert isinstance(spool.put(np.zeros(4, np.int32)), SpooledRouted)
    spool.close()


def test_a_new_process_numbers_its_segments_past_those_already_there(tmp_path):
    """A resumed run's checkpoint names segments of the process before it: they are never reused."""
    (tmp_path / "routed_000004.bin").write_bytes(b"\x05" * 100)  # left by an earlier process of the run
    spool = RoutedSpool(tmp_path)
    ref = spool.put(np.arange(6, dtype=np.int8))
    spool.flush()
    assert ref.file == "routed_000005.bin" and ref.offset == 0
    assert (tmp_path / ref.file).read_bytes() == bytes(range(6))
    assert (tmp_path / "routed_000004.bin").read_bytes() == b"\x05" * 100
    spool.close()


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("routed_*.bin"))


def test_a_trained_samples_segment_stays_while_a_checkpoint_a_resume_may_load_names_it(tmp_path):
    """Checkpoint v2 holds samples a-d (finished, not trained); a is trained after it, b after v4.
    A resume may load the newest complete checkpoint or, when that one is corrupt, the one before:
    a's segment goes once v2 is neither (v6 complete), b's once v4 is neither (v8); c, still held,
    stays throughout; and nothing goes while the newer checkpoint is only being written."""
    spool = RoutedSpool(tmp_path, segment_bytes=8)
    a, b, c, d = (spool.put(np.full(8, i, np.int8)) for i in range(4))  # one segment each, d's open
    spool.checkpoint_cut(2)
    spool.checkpoint_completed(2)
    spool.retire([a])
    spool.flush()
    assert _names(tmp_path) == [a.file, b.file, c.file, d.file]  # v2 names a
    spool.checkpoint_cut(4)
    spool.checkpoint_completed(4)
    spool.retire([b])
    spool.flush()
    assert _names(tmp_path) == [a.file, b.file, c.file, d.file]  # v2 is v4's fallback
    spool.checkpoint_cut(6)
    spool.flush()
    assert a.file in _names(tmp_path)  # v6 is being written: v2 is still the fallback of v4
    spool.checkpoint_completed(6)
    spool.flush()
    assert _names(tmp_path) == [b.file, c.file, d.file]
    spool.checkpoint_cut(8)
    spool.checkpoint_completed(8)
    spool.flush()
    assert _names(tmp_path) == [c.file, d.file]  # c is held: no checkpoint is past it
    spool.close()  # the run ends: c and d are in v8 (held at its cut), which a resume may load
    assert _names(tmp_path) == [c.file, d.file]


def test_the_last_checkpoint_completing_after_the_spool_closed_still_frees_what_it_passed(tmp_path):
    spool = RoutedSpool(tmp_path, segment_bytes=8)
    a, b = spool.put(np.zeros(8, np.int8)), spool.put(np.ones(8, np.int8))
    spool.checkpoint_cut(2)
    spool.checkpoint_completed(2)
    spool.retire([a])
    for v in (4, 6):
        spool.checkpoint_cut(v)
    spool.checkpoint_completed(4)
    spool.close()  # the run's end, with v6 still being written
    assert _names(tmp_path) == [a.file, b.file]  # v2 is v4's fallback
    spool.checkpoint_completed(6)  # v2 is no longer loaded by a resume
    assert _names(tmp_path) == [b.file]  # b, held at v6's cut, stays


def test_a_dropped_sample_goes_at_once_without_checkpoints_and_its_segment_shares_are_counted(tmp_path):
    """A sample dropped untrained (an answer replaced it, the run ended) frees its segment once
    every other sample of that segment is gone too; without checkpoints, at once."""
    spool = RoutedSpool(tmp_path, segment_bytes=16)
    a, b = spool.put(np.zeros(8, np.int8)), spool.put(np.ones(8, np.int8))  # one segment
    c = spool.put(np.full(8, 2, np.int8))  # the next one, open
    assert a.file == b.file != c.file
    spool.retire([a])
    spool.flush()
    assert _names(tmp_path) == [a.file, c.file]  # b is still held
    spool.retire([b])
    spool.flush()
    assert _names(tmp_path) == [c.file]
    spool.close()  # c, still held, is dropped at the run's end; no checkpoint names it
    assert not tmp_path.exists() or _names(tmp_path) == []


def test_resume_holds_what_the_checkpoint_names_refuses_a_missing_or_short_segment_and_drops_the_rest(tmp_path):
    first = RoutedSpool(tmp_path, segment_bytes=8)
    kept, orphan, short = (first.put(np.full(8, i, np.int8)) for i in range(3))
    first.flush()  # then the job is killed: nothing closes the spool
    (tmp_path / short.file).write_bytes(b"\x02" * 5)  # a torn write
    second = RoutedSpool(tmp_path, segment_bytes=8)
    assert second.adopt(kept) is None
    assert second.adopt(short) == f"{tmp_path / short.file} has 5 bytes, its 8 int8 ids end at byte 8"
    missing = SpooledRouted("routed_000009.bin", 0, 4, "int16")
    assert second.adopt(missing).startswith(f"{tmp_path / missing.file} is missing")
    second.resumed()
    assert _names(tmp_path) == [kept.file]  # the crashed lineage's samples no checkpoint names went
    nxt = second.put(np.full(8, 9, np.int8))
    second.flush()
    assert nxt.file == "routed_000003.bin"  # past every number the checkpoint may name
    second.retire([kept])  # trained after the resume: the loaded checkpoint still names it
    second.flush()
    assert kept.file in _names(tmp_path)
    for v in (10, 12):
        second.checkpoint_cut(v)
        second.checkpoint_completed(v)
    second.flush()
    assert kept.file not in _names(tmp_path) and nxt.file in _names(tmp_path)
    first.close()
    second.close()


def _store(tmp_path):
    from dora_megatron.config.rollout import RolloutConfig
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.data.codec import CharCodec
    from dora_megatron.data.tasks import RunningSumTask

    store = SampleStore(RunningSumTask(1, 30, 1.2, seed=1), CharCodec(), lambda item: None,
                        RolloutConfig(max_new_tokens=8), seed=0)
    store.routed_spool = RoutedSpool(tmp_path / SPOOL_DIR, segment_bytes=12)
    return store


def _finish(store) -> None:
    for rec in store.samples.values():
        rec.response_ids.extend(array("i", [5, 6]))
        rec.rollout_logprobs.extend(array("f", [-0.1, -0.2]))
        rec.finished, rec.reward = True, 1.0


def test_the_store_keeps_only_where_the_spool_holds_a_samples_routing_and_hands_the_trainer_that(tmp_path):
    """The sample store queues each finished sample's routed experts to the spool (the loop does
    not write them) and keeps only their location, for its batch, checkpoint and journal; a later
    answer's routing replaces an earlier one (whose segment goes); a sample without routing, or
    restored without a spool entry, hands its array."""
    from dora_megatron.orchestrator import Dispatch, ReleaseBatch

    store = _store(tmp_path)
    store.dispatch(Dispatch("g0", 0, ["g0/0", "g0/1", "g0/2"]))
    ids = [_routed(12, 60, i) for i in range(3)]
    store.keep_routed(store.samples["g0/1"], ids[1])  # segment 0
    dropped = store.samples["g0/1"].routed_experts
    store.keep_routed(store.samples["g0/0"], ids[0])  # segment 1, the open one
    store.keep_routed(store.samples["g0/1"], None)  # a malformed later answer: no routing, no spool entry
    rec2 = store.samples["g0/2"]
    rec2.routed_experts = ids[2]  # restored from an older checkpoint: its array, no spool entry
    _finish(store)
    held = store.samples["g0/0"].routed_experts
    assert isinstance(held, SpooledRouted) and held.count == 12  # a location, not the ids
    _, entries = store.state_entries()
    assert [("routed_at" in e, "routed_experts" in e) for e in entries] == [(True, False), (False, False),
                                                                             (False, True)]
    assert entries[0]["routed_at"] == [held.file, held.offset, 12, "int8"]
    store.routed_spool.flush()
    assert _names(tmp_path / SPOOL_DIR) == [held.file] and dropped.file != held.file  # the dropped one went
    samples, _, _ = store.take_batch(ReleaseBatch(1, ("g0",), (0,)), 0.0, dump=False)
    assert samples[0].routed_experts is held and samples[1].routed_experts is None
    assert samples[2].routed_experts is ids[2]
    got = np.fromfile(tmp_path / SPOOL_DIR / held.file, dtype=held.dtype, count=held.count, offset=held.offset)
    assert got.tolist() == ids[0].tolist()
    store.routed_spool.close()


def _state(store, groups, samples) -> dict:
    """controller.json's entries the store reads back, with the orchestrator snapshot's ids."""
    return {"next_prompt": 1, "groups": groups, "samples": samples,
            "orchestrator": {"groups": [{"group_id": g["group_id"], "sample_ids": [s["sample_id"] for s in samples],
                                         "version": 0} for g in groups],
                             "samples": [{"sample_id": s["sample_id"], "version": 0} for s in samples]}}


def test_a_resume_reads_the_checkpoints_spooled_routing_back_and_refuses_a_missing_segment(tmp_path):
    from dora_megatron.comm.routed_spool import SpoolError
    from dora_megatron.orchestrator import Dispatch

    store = _store(tmp_path)
    store.dispatch(Dispatch("g0", 0, ["g0/0", "g0/1"]))
    ids = [_routed(12, 60, 7), _routed(12, 60, 8)]
    for i in range(2):
        store.keep_routed(store.samples[f"g0/{i}"], ids[i])
    _finish(store)
    store.routed_spool.flush()
    groups, samples = store.state_entries()
    state = _state(store, groups, samples)  # then the job is killed

    again = _store(tmp_path)
    again.load_entries(state)
    again.routed_spool.resumed()
    for i in range(2):
        ref = again.samples[f"g0/{i}"].routed_experts
        assert isinstance(ref, SpooledRouted)
        got = np.fromfile(tmp_path / SPOOL_DIR / ref.file, dtype=ref.dtype, count=ref.count, offset=ref.offset)
        assert got.tolist() == ids[i].tolist()

    (tmp_path / SPOOL_DIR / samples[1]["routed_at"][0]).unlink()
    third = _store(tmp_path)
    with pytest.raises(SpoolError, match=rf"sample g0/1 of the checkpoint: .*{tmp_path / SPOOL_DIR / samples[1]['routed_at'][0]} is missing"):
        third.load_entries(state)
    for s in (store, again, third):
        s.routed_spool.close()
