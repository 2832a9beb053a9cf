"""The rollup watermarks: how far each raw table (samples, job_samples) is rolled up into its 1-minute table.

The analysis' rollup reads and advances them; the store's maintenance, which deletes and rewrites raw rows,
re-sets them in the same transaction. They are table rows of the store, so they live here, below both.
"""

from __future__ import annotations

from gpuagent.common.timeutil import utc_now


def _row_key(con, source: str, rowid: int) -> int | None:
    row = con.execute(f"SELECT hash(s) FROM {source} s WHERE rowid = ?", [rowid]).fetchone()
    return None if row is None else int(row[0])


# The rollup watermark is a row count, not a rowid. DuckDB renumbers rowids whenever a checkpoint drops or
# merges row groups that hold deleted rows, but it never reorders the rows that stay, and it appends new rows
# after all others. Raw rows are only ever deleted or rewritten once they are rolled up (store/maintenance.py
# rolls up first and re-sets the count in the same transaction as the change), so the rolled-up rows are
# always the first ``last_count`` rows in rowid order and the rows not yet rolled up are the last
# count(*) - last_count: in whatever numbering the table has now, rowid in (max(rowid) - that, max(rowid)].
# ``last_key`` (the hash of the last rolled-up row, NULL when maintenance set the count) and the tail's
# row count check that nothing else deleted rows behind the analyzer's back; when either disagrees the
# rollup rebuilds. ``last_rowid`` is max(rowid) at the last analyzer pass, kept for reading only.


def watermark_of(con, source: str) -> tuple[int, int, int | None]:
    """(max rowid, row count, hash of the row at max rowid) of a rollup source, as a watermark."""
    hi, count = con.execute(f"SELECT max(rowid), count(*) FROM {source}").fetchone()
    hi = -1 if hi is None else int(hi)
    return hi, int(count), (_row_key(con, source, hi) if hi >= 0 else None)



def set_watermark(con, source: str, hi: int, count: int, key: int | None) -> None:
    con.execute("INSERT OR REPLACE INTO rollup_watermarks (source, last_rowid, updated_at, last_count, last_key) "
                "VALUES (?, ?, ?, ?, ?)", [source, hi, utc_now(), count, key])


def mark_all_rolled_up(con, source: str) -> None:
    """Record every row ``source`` holds as rolled up, inside the transaction that changed them (maintenance:
    the rows it deleted or rewrote were rolled up just before). Rowids of rows this transaction wrote are
    not final until it commits, so only the count is set; the next pass sets the key again."""
    con.execute(f"UPDATE rollup_watermarks SET last_count = (SELECT count(*) FROM {source}), last_key = NULL, "
                "updated_at = ? WHERE source = ?", [utc_now(), source])


def rolled_up_rowid(con, source: str, hi: int, count: int) -> int | None:
    """The highest rowid, in the numbering ``con`` sees now, of the rows of ``source`` already rolled up
    (-1: none); None when the watermark cannot tell (then the rollup rebuilds). ``hi`` and ``count`` are
    ``source``'s max(rowid) and count(*) in the same snapshot. Rows above it number count - last_count; the
    caller checks that (a hole among them means rows were deleted that were never rolled up)."""
    wm = con.execute("SELECT last_count, last_key FROM rollup_watermarks WHERE source = ?", [source]).fetchone()
    if wm is None:
        return -1
    last_count, last_key = wm
    if last_count is None:
        return None
    fresh = count - int(last_count)
    lo = hi - fresh
    if fresh < 0 or lo < -1 or (last_count > 0 and lo < 0):
        return None
    if last_key is not None and last_count > 0 and _row_key(con, source, lo) != int(last_key):
        return None
    return lo

