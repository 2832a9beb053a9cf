"""The writer keeps room to checkpoint on a small volume (a real tmpfs, root only): a commit that would take
that room is refused with one sentence and nothing of it is stored, the database can still checkpoint, and
once space is freed the same batch is stored exactly once."""

from __future__ import annotations

import urllib.request
from concurrent.futures import Future

import duckdb
import pytest

from collector_helpers import NOW_NS, sample_batch
from conftest import free_port, mounted_tmpfs
from gpuagent.collector.ingest.validate import prepare_batch
from gpuagent.collector.store.db import open_database
from gpuagent.collector.store.space import SpaceCheck
from gpuagent.collector.store.writer import NoSpace, Writer


@pytest.fixture
def tmpfs_64m(tmp_path):
    """A real 64 MiB tmpfs, unmounted even when the test fails."""
    yield from mounted_tmpfs(tmp_path, "vol", "64m")


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


def _fill(path) -> None:
    """Write until the volume says ENOSPC: another program taking the room the writer kept."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError as exc:
            assert exc.errno == 28, exc


def test_an_invalidated_database_is_reopened_in_place_and_stores_each_batch_once(tmpfs_64m):
    """A checkpoint without room (the volume filled by someone else) invalidates the database; the writer
    reopens it from its file and WAL, refuses batches meanwhile, and stores them once room is back."""
    db = str(tmpfs_64m / "c.duckdb")
    opened = []

    def reopen(old):
        old.close()
        con = open_database(db)
        opened.append(con)
        return con

    con = open_database(db)
    writer = Writer(con, space=SpaceCheck(db), reopen=reopen)

    def count() -> int:
        return writer.call(lambda c: c.execute("SELECT count(*) FROM samples").fetchone()[0]).result()

    try:
        n = 50_000
        for seq in (1, 2, 3):
            ack, exc = _store(writer, seq, n)
            assert exc is None and ack.seq == seq
        filler = tmpfs_64m / "filler"
        _fill(filler)
        # The checkpoint DuckDB would run by itself at some commit, run now: it cannot write its blocks.
        with pytest.raises(Exception) as failed:
            writer.call(lambda c: c.execute("CHECKPOINT")).result()
        print("checkpoint on a full volume:", failed.value)
        assert "No space left" in str(failed.value)
        assert count() == 3 * n, "the committed rows did not come back from the WAL after the reopen"
        assert writer.stats["reopens"] == 1 and writer.closed_reason is None and writer.fatal is None
        assert len(opened) == 1
        # Still full: the next batch is refused, one sentence, nothing stored.
        ack, exc = _store(writer, 4, n)
        assert ack is None and isinstance(exc, NoSpace) and "\n" not in str(exc), exc
        assert count() == 3 * n
        filler.unlink()
        ack, exc = _store(writer, 3, n)        # a resend of a batch from before the reopen: only acknowledged
        assert exc is None and ack.duplicate
        ack, exc = _store(writer, 4, n)
        assert exc is None and not ack.duplicate and ack.highest_committed_seq == 4
        writer.call(lambda c: c.execute("CHECKPOINT")).result()
        assert count() == 4 * n and writer.stats["reopens"] == 1
    finally:
        writer.stop()
        writer.con.close()


def test_a_database_that_cannot_be_reopened_stops_the_writer_with_one_sentence(tmp_path):
    """Reopening fails for a reason other than space (here: the file is gone): the writer gives up, ``fatal``
    says why, and every later batch is refused rather than half-stored."""
    db = str(tmp_path / "c.duckdb")

    def reopen(old):
        old.close()
        raise RuntimeError(f"cannot open the database {db}: it is not a DuckDB file")

    con = open_database(db)
    writer = Writer(con, reopen=reopen)
    try:
        ack, exc = _store(writer, 1, 10)
        assert exc is None
        # Stand in for DuckDB's invalidation with the error it raises, through the writer's own path.
        def boom(c):
            raise duckdb.FatalException("FATAL Error: Failed: database has been invalidated because of a previous "
                                        "fatal error.")
        with pytest.raises(duckdb.FatalException):
            writer.call(boom).result()
        assert writer.fatal is not None and "cannot be reopened" in writer.fatal and "\n" not in writer.fatal
        print("fatal:", writer.fatal)
        ack, exc = _store(writer, 2, 10)
        assert ack is None and "restarts" in str(exc)
        assert writer.stats["reopens"] == 0
    finally:
        writer.stop()


def test_a_collector_whose_database_was_invalidated_answers_again_without_a_restart(tmpfs_64m):
    """Over real gRPC: after the invalidation the Query endpoint and the streams work again in the same
    process, the collector reports no problem (so systemd does not restart it into a full disk), and the
    metrics count the reopen."""
    import grpc

    from collector_helpers import node_info
    from gpuagent import local_run
    from gpuagent.collector.service import start_collector
    from gpuagent.proto import pb, pb_grpc

    db = tmpfs_64m / "c.duckdb"
    with start_collector(db, analyze=False, metrics_listen=f"127.0.0.1:{free_port()}") as h, \
            grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node = stub.Register(pb.RegisterRequest(node=node_info("disk-01", "m-disk"))).node_id
        acks = list(stub.Stream(iter([sample_batch(node, s, n=20_000) for s in (1, 2)]), timeout=60))
        assert [a.seq for a in acks] == [1, 2]
        filler = tmpfs_64m / "filler"
        _fill(filler)
        with pytest.raises(Exception):
            h.writer.call(lambda c: c.execute("CHECKPOINT")).result()
        assert h.problem() is None, h.problem()
        _, rows = local_run.query(f"127.0.0.1:{h.port}", "SELECT count(*) AS n FROM samples", timeout=10.0)
        assert rows == [[40_000]], rows
        text = urllib.request.urlopen(f"http://127.0.0.1:{h.metrics.port}/metrics", timeout=10).read().decode()
        assert "gpuagent_collector_database_reopens_total 1.0" in text
        assert "gpuagent_collector_database_closed 0.0" in text
        filler.unlink()
        acks = list(stub.Stream(iter([sample_batch(node, 2, n=20_000), sample_batch(node, 3, n=20_000)]),
                                timeout=60))
        assert [(a.seq, a.duplicate) for a in acks] == [(2, True), (3, False)]
        _, rows = local_run.query(f"127.0.0.1:{h.port}", "SELECT count(*) AS n FROM samples", timeout=10.0)
        assert rows == [[60_000]], rows
