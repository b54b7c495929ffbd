"""The write-ahead journal keeps what a one-checkpoint fallback needs while a newer checkpoint is written."""

from array import array

from dora_megatron.controller.journal import Journal, JournaledSample, read_journal, segments


def finished(journal: Journal, sid: str, version: int) -> None:
    journal.sample(JournaledSample(sid, sid.split(".")[0], version, 0, (1, 2), (-0.5, -0.5), 1.0), [version])


def test_a_crash_while_a_checkpoint_is_written_keeps_the_records_of_the_fallback(tmp_path):
    """Checkpoints 2 and 4 are complete and 6 is cut but its controller.json not written when the job
    dies: resume takes 4, and if 4 is corrupt, falls back to 2, whose records must still be there."""
    j = Journal(tmp_path)
    j.start(0)
    j.checkpoint(2)
    j.completed(2)
    finished(j, "g1.0", 2)
    j.checkpoint(4)
    j.completed(4)
    finished(j, "g2.0", 2)  # a long-tail sample of version 2 finishes after checkpoint 4
    finished(j, "g4.0", 4)
    j.checkpoint(6)  # the cut; the crash lands before completed(6)
    finished(j, "g3.0", 6)
    j.close()
    assert set(read_journal(tmp_path, 2)) == {"g1.0", "g2.0"}
    assert set(read_journal(tmp_path, 4)) == {"g2.0", "g4.0"}


def test_a_complete_checkpoint_drops_the_segments_no_fallback_reads(tmp_path):
    j = Journal(tmp_path)
    j.start(None)
    for v in (2, 4, 6, 8):
        j.checkpoint(v)
        finished(j, f"g{v}.0", v)
        finished(j, f"t{v}.0", v - 2)  # a long-tail sample of the version before
        j.completed(v)
    j.close()
    # resume takes 8 or falls back to 6: segments from 6 on are kept, older ones are gone
    assert [p.name for p in segments(tmp_path)] == ["journal.v000006.jsonl"]
    assert set(read_journal(tmp_path, 6)) == {"g6.0", "t6.0", "t8.0"}
    assert read_journal(tmp_path, 4) == {}
    j2 = Journal(tmp_path)
    j2.start(6)  # a resumed lineage starts a fresh journal
    j2.close()
    assert segments(tmp_path) == [] and read_journal(tmp_path, 6) == {}


class _Ids(array):
    """Token ids (an int32 array, as a sample holds them) that note the thread that turns them into
    the journal's list."""

    threads: list[int] = []

    def tolist(self):
        import threading

        self.threads.append(threading.get_ident())
        return super().tolist()


def test_samples_are_encoded_by_the_writer_thread_in_order_and_replay_once(tmp_path):
    """The journal is given the samples' own arrays (int32 ids, float32 log-probs, int8 routed
    experts) and returns at once; its thread encodes them, in the order given, with the checkpoint
    markers where they were cut: a resume reads each sample once, the routed experts as SGLang's
    base64 of int32 and the ids and log-probs as given."""
    import base64
    import threading
    from array import array

    import numpy as np

    from dora_megatron.comm.batch_files import B64_IDS

    j = Journal(tmp_path)
    j.start(0)
    routed = (np.arange(B64_IDS * 2 + 5) % 120).astype(np.int8)  # more than one base64 slice
    for i in range(50):
        ids = _Ids("i", [i, i + 1, 7])
        j.sample(JournaledSample(f"g{i}.0", f"g{i}", 0, i, ids, array("f", [-0.25, -1.5, float(-i)]), i / 10,
                                 routed if i == 3 else None), [0])
        if i == 24:
            j.checkpoint(2)  # split exactly here, though the records before it may not be written yet
    j.sample(JournaledSample("g0.0", "g0", 0, 0, (9,), (-0.5,), 1.0), [0])  # the same sample again: the later wins
    j.close()
    assert set(_Ids.threads) and threading.get_ident() not in _Ids.threads
    first, second = read_journal(tmp_path, 0), read_journal(tmp_path, 2)
    # from marker 0 every sample is read (once, the later record of g0.0 winning), from marker 2 those after it
    assert sorted(first) == sorted(f"g{i}.0" for i in range(50)) and first["g0.0"].response_ids == (9,)
    assert sorted(second) == sorted([*(f"g{i}.0" for i in range(25, 50)), "g0.0"])
    assert first["g7.0"].response_ids == (7, 8, 7) and first["g7.0"].rollout_logprobs == (-0.25, -1.5, -7.0)
    assert first["g3.0"].routed_experts == base64.b64encode(routed.astype("<i4").tobytes()).decode()
    assert first["g4.0"].routed_experts is None and first["g4.0"].reward == 0.4


def test_a_failed_write_is_raised_to_the_caller_not_lost(tmp_path):
    """The writer thread's failure (here: the run directory is gone when the segment is rotated)
    reaches the controller at the next call instead of the journal silently ending."""
    import shutil

    import pytest

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    j = Journal(run_dir)
    j.start(0)
    finished(j, "g1.0", 0)
    j.flush()
    assert set(read_journal(run_dir, 0)) == {"g1.0"}
    shutil.rmtree(run_dir)
    j.checkpoint(2)
    with pytest.raises(RuntimeError, match="journal writer failed"):
        j.flush()
    with pytest.raises(RuntimeError, match="journal writer failed"):
        j.close()
