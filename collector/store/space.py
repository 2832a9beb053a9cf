"""Room on the database's volume for a commit and the checkpoint after it (``SpaceCheck``).

The writer (store/writer.py) asks before each commit: DuckDB answers a full disk during a commit's WAL
write with a clean error, but during a checkpoint it invalidates the database, so a commit that would take
the checkpoint's room is refused instead. Kept apart from the writer because it is a measure of the volume
and the WAL with its own calibration (benchmarks/checkpoint_space.py), not part of storing a batch.
"""

from __future__ import annotations

import logging
import os
import shutil

import duckdb

from gpuagent.common.errors import first_line

log = logging.getLogger("gpuagent.collector.store.writer")   # the writer's own check: its log name

# The fixed part of what a checkpoint may write, with a margin: the last, partly filled row group of every
# table appended to is rewritten whole, with the tables' indexes and metadata (measured: up to 5 MiB).
SPACE_RESERVE_BYTES = 16 << 20


def _size(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


class SpaceCheck:
    """Keeps the room a checkpoint needs on the database's volume, refusing a commit that would take it.

    DuckDB checkpoints by itself when a commit takes the WAL past ``wal_autocheckpoint``, and the disk
    guard checkpoints too. A checkpoint writes new blocks (into the file's free blocks, or growing the
    file) before it frees any, and if the volume fills meanwhile DuckDB invalidates the database; a
    commit that finds the volume full only fails. A commit of ``n`` bytes (its rows' Arrow size) writes
    them to the WAL or, when large, straight into new blocks; a checkpoint writes every row committed
    since the previous one again, compressed, and rewrites some blocks besides.

    Measured with benchmarks/checkpoint_space.py (SYNTHETIC fleet, DuckDB 1.5): a commit's WAL took up
    to 1.6 ``n``; a checkpoint wrote up to 0.8 times the Arrow bytes pending after an hour of a fleet,
    and up to 5 MiB plus 2.5 times them after a few minutes. The estimates, ``2 n`` for the commit and
    3 times the pending bytes plus ``reserve`` for the checkpoint, keep a margin of about two.

    When the room left is under twice what the next commit and its checkpoint need, the pending rows are
    checkpointed now, while that fits, so that later checkpoints stay small; a commit that still does not
    fit is refused (the agent keeps the batch and resends it).
    """

    def __init__(self, db_path: str, reserve: int = SPACE_RESERVE_BYTES):
        self.db_path = db_path
        self.wal_path = db_path + ".wal"
        self.folder = os.path.dirname(os.path.abspath(db_path))
        self.reserve = reserve
        self.pending = 0              # Arrow bytes committed since the last checkpoint seen
        self._wal_after = 0           # the WAL's size after the last commit
        self.checkpoints = 0          # checkpoints run early because space was getting short

    def _volume_and_wal(self) -> tuple[int, int]:
        try:
            wal = os.stat(self.wal_path).st_size
        except FileNotFoundError:
            wal = 0
        return shutil.disk_usage(self.folder).free, wal

    @staticmethod
    def _free_blocks(con) -> int:
        row = con.execute("SELECT free_blocks * block_size FROM pragma_database_size() "
                          "WHERE database_name = current_database()").fetchone()
        return int(row[0]) if row else 0

    def _checkpoint_bytes(self, pending: int) -> int:
        return 3 * pending + self.reserve

    def need(self, n: int) -> int:
        """Bytes a commit of ``n`` Arrow bytes and a checkpoint after it may write."""
        return 2 * n + self._checkpoint_bytes(self.pending + n)

    def shortfall(self, con, n: int) -> str | None:
        """None when a commit of about ``n`` bytes fits; else one sentence on what is short."""
        volume, wal = self._volume_and_wal()
        if wal < self._wal_after:         # a checkpoint ran since the last commit (the guard's, say)
            self.pending = 0
        self._wal_after = wal
        if volume >= 2 * self.need(n):    # the usual case: no query needed
            return None
        blocks = self._free_blocks(con)
        if volume + blocks >= 2 * self.need(n):
            return None
        # Early, but only when that shrinks the estimate by a quarter of ``reserve`` or more.
        if 3 * self.pending >= self.reserve // 4 and volume + blocks >= self._checkpoint_bytes(self.pending):
            try:
                con.execute("CHECKPOINT")
                self.checkpoints += 1
                self.pending = 0
            except duckdb.FatalException:
                raise
            except duckdb.Error as exc:   # a reader holds a transaction; decide on what is measured
                log.info("early checkpoint for space deferred: %s", first_line(exc))
            volume, self._wal_after = self._volume_and_wal()
            blocks = self._free_blocks(con)
        if volume >= 2 * n and volume + blocks >= self.need(n):
            return None
        return (f"the database's volume has {_size(volume)} free and the database {_size(blocks)} of free "
                f"blocks, less than the {_size(self.need(n))} that storing {_size(n)} and the checkpoint after it "
                f"may write")

    def reopened(self) -> None:
        """After the database was reopened: its WAL is replayed but not yet checkpointed; count it pending."""
        _, wal = self._volume_and_wal()
        self.pending = max(self.pending, wal)
        self._wal_after = wal

    def committed(self, n: int) -> None:
        """After a commit of ``n`` bytes: a WAL that shrank means DuckDB checkpointed (this commit too)."""
        _, wal = self._volume_and_wal()
        self.pending = 0 if wal < self._wal_after else self.pending + n
        self._wal_after = wal
