"""Routed experts spooled as samples finish (dora_megatron.comm.routed_spool): a batch names where
they are instead of copying them, each rank reads back exactly the ids it trains, a bad
``routed_at`` is refused naming the sample, trained segments go, a failed write is raised."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import pytest

from dora_megatron.comm.batch_files import BatchFileError, BatchReader, write_batch
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
        reader = BatchReader(entry)
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
    (["../secret.bin", 0, "int8"], r"batch\.samples\[1\]\.routed_at must be"),
    (["routed_000000.bin", -1, "int8"], r"batch\.samples\[1\]\.routed_at must be"),
    (["routed_000000.bin", 0, "float32"], r"batch\.samples\[1\]\.routed_at must be"),
    (["routed_000000.bin", 10, "int8"], r"batch\.samples\[1\]\.routed_at: 16 int8 ids at byte 10 end past the 20"),
    (["routed_000009.bin", 0, "int8"], r"batch\.samples\[1\]\.routed_at: cannot read the spool segment"),
])
def test_a_bad_routed_at_is_refused_naming_the_sample(tmp_path, at, match):
    spool = RoutedSpool(tmp_path / SPOOL_DIR)
    samples = [_sample(0, spool.put(_routed(4, 8, 0))), _sample(1, spool.put(_routed(16, 8, 1)))]
    spool.flush()
    entry = write_batch(tmp_path / "step_000000", samples)
    assert entry["samples"][1]["routed_at"] == ["routed_000000.bin", 4, "int8"]
    BatchReader(entry).samples([0, 1])  # as written: read
    entry["samples"][1]["routed_at"] = at
    with pytest.raises(BatchFileError, match=match):
        BatchReader(entry)
    spool.close()


def test_a_segment_goes_once_all_its_samples_were_trained_and_the_open_one_stays(tmp_path):
    spool = RoutedSpool(tmp_path, segment_bytes=10)
    refs = [spool.put(np.full(8, i, np.int8)) for i in range(3)]  # 8 bytes each: one segment per sample
    spool.flush()
    assert [r.file for r in refs] == ["routed_000000.bin", "routed_000001.bin", "routed_000002.bin"]
    spool.release(refs[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routed_000001.bin", "routed_000002.bin"]
    spool.release(refs[2:])  # the open segment: kept for the next samples
    assert (tmp_path / "routed_000002.bin").exists()
    nxt = spool.put(np.full(8, 7, np.int8))  # rotates: the emptied segment 2 goes
    spool.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routed_000001.bin", "routed_000003.bin"]
    assert np.fromfile(tmp_path / nxt.file, np.int8).tolist() == [7] * 8
    spool.close(remove=False)


def test_a_failed_write_is_raised_by_flush(tmp_path):
    blocker = tmp_path / "spool"
    blocker.write_text("a file where the spool's directory should be")
    spool = RoutedSpool(blocker)
    spool.put(np.zeros(4, np.int8))
    with pytest.raises(OSError):
        spool.flush()
    spool.close(remove=False)


def test_put_refuses_ids_that_are_not_a_compact_integer_type(tmp_path):
    spool = RoutedSpool(tmp_path)
    with pytest.raises(ValueError, match="float32 ids"):
        spool.put(np.zeros(4, np.float32))
    assert isinstance(spool.put(np.zeros(4, np.int32)), SpooledRouted)
    spool.close()


def test_a_new_process_truncates_a_stale_segment_of_the_same_name(tmp_path):
    (tmp_path / "routed_000000.bin").write_bytes(b"\x05" * 100)  # left by a crashed process of the run
    spool = RoutedSpool(tmp_path)
    ref = spool.put(np.arange(6, dtype=np.int8))
    spool.flush()
    assert ref.offset == 0 and Path(tmp_path / ref.file).read_bytes() == bytes(range(6))
    spool.close(remove=False)


def test_the_store_spools_a_finished_samples_routing_and_hands_the_trainer_where_it_is(tmp_path):
    """The sample store queues each finished sample's routed experts to the spool (the loop does
    not write them), keeps the array for its checkpoint, and its batch names the spooled ids once
    per sample; a sample without routing, or restored without a spool entry, hands its array."""
    from dora_megatron.controller.records import RuntimeOptions
    from dora_megatron.controller.samples import SampleStore
    from dora_megatron.data.codec import CharCodec
    from dora_megatron.data.tasks import RunningSumTask
    from dora_megatron.orchestrator import Dispatch, ReleaseBatch

    opts = RuntimeOptions(steps=1, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1,
                          snapshot_dir=lambda v: f"/snap/v{v}", routed_experts=True)
    store = SampleStore(RunningSumTask(1, 30, 1.2, seed=1), CharCodec(), lambda item: None, opts)
    store.routed_spool = RoutedSpool(tmp_path / SPOOL_DIR)
    store.dispatch(Dispatch("g0", 0, ["g0/0", "g0/1", "g0/2"]))
    ids = [_routed(12, 60, i) for i in range(3)]
    store.keep_routed(store.samples["g0/0"], ids[0])
    store.keep_routed(store.samples["g0/1"], ids[1])
    store.keep_routed(store.samples["g0/1"], None)  # a malformed later answer: no routing, no spool entry
    rec2 = store.samples["g0/2"]
    rec2.routed_experts = ids[2]  # restored from a checkpoint: its array, no spool entry
    for rec in store.samples.values():
        rec.output_ids.extend(array("i", [5, 6]))
        rec.logprobs.extend(array("f", [-0.1, -0.2]))
        rec.finished, rec.reward = True, 1.0
    assert store.samples["g0/0"].routed_experts is ids[0]  # kept for checkpoints and the journal
    samples, _, _ = store.take_batch(ReleaseBatch(1, ("g0",), (0,)), 0.0, dump=False)
    assert isinstance(samples[0].routed_experts, SpooledRouted) and samples[1].routed_experts is None
    assert samples[2].routed_experts is ids[2]
    store.routed_spool.flush()
    ref = samples[0].routed_experts
    got = np.fromfile(tmp_path / SPOOL_DIR / ref.file, dtype=ref.dtype, count=ref.count, offset=ref.offset)
    assert got.tolist() == ids[0].tolist()
    store.routed_spool.close()
