"""The write-ahead journal keeps what a one-checkpoint fallback needs while a newer checkpoint is written."""

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
