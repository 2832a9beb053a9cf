"""The writer keeps room to checkpoint on a small volume (a real tmpfs, root only): a commit that would take
that room is refused with one sentence and nothing of it is stored, the database can still checkpoint, and
once space is freed the same batch is stored exactly once."""

from __future__ import annotations

import subprocess
from concurrent.futures import Future

import pytest

from collector_helpers import NOW_NS, sample_batch
from gpuagent.collector.ingest.validate import prepare_batch
from gpuagent.collector.store.db import open_database
from gpuagent.collector.store.writer import NoSpace, SpaceCheck, Writer


@pytest.fixture
def tmpfs_64m(tmp_path):
    """A real 64 MiB tmpfs, unmounted even when the test fails."""
    mnt = tmp_path / "vol"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _store(writer: Writer, seq: int, n: int):
    """Submit one batch of ``n`` samples and wait for the writer's answer: (ack, error)."""
    done: Future = Future()
    batch = sample_batch("space-node", seq, n=n, ts0=NOW_NS - 3 * 3600 * 10**9)
    writer.submit(prepare_batch(batch), lambda ack, exc: done.set_result((ack, exc)))
    return done.result(timeout=120)


def test_writer_refuses_a_batch_before_the_volume_lacks_room_to_checkpoint(tmpfs_64m):
    db = str(tmpfs_64m / "c.duckdb")
    filler = tmpfs_64m / "filler"
    filler.write_bytes(b"\0" * (16 << 20))        # space that "someone else" gives back later
    con = open_database(db)
    writer = Writer(con, space=SpaceCheck(db))

    def count() -> int:
        return writer.call(lambda c: c.execute("SELECT count(*) FROM samples").fetchone()[0]).result()

    try:
        n, stored, refused = 100_000, 0, None
        for seq in range(1, 200):
            ack, exc = _store(writer, seq, n)
            if exc is not None:
                refused = (seq, exc)
                break
            assert ack.seq == seq and not ack.duplicate
            stored += n
        assert refused is not None, "the volume never ran short"
        seq, exc = refused
        print(f"refused seq {seq} after {stored} samples: {exc}; early checkpoints: {writer.space.checkpoints}")
        assert isinstance(exc, NoSpace) and "refused before the disk fills" in str(exc)
        assert "\n" not in str(exc) and writer.fatal is None
        assert writer.stats["refused_no_space"] == 1 and writer.stats["samples"] == stored
        assert count() == stored                            # nothing of the refused batch
        # The room was kept: a checkpoint still succeeds and loses nothing.
        writer.call(lambda c: c.execute("CHECKPOINT")).result()
        assert count() == stored and writer.fatal is None

        filler.unlink()
        ack, exc = _store(writer, seq, n)                   # the resend, once there is room again
        assert exc is None and ack.seq == seq and not ack.duplicate
        ack, exc = _store(writer, seq, n)                   # and a second resend is only acknowledged
        assert exc is None and ack.duplicate
        assert count() == stored + n
        assert writer.call(lambda c: c.execute("SELECT count(*) FROM ingest_log WHERE node_id = 'space-node'")
                           .fetchone()[0]).result() == seq
    finally:
        writer.stop()
        con.close()
