"""The incremental 1-minute rollups (samples_1m, job_samples_1m): read the raw rows past the watermark in
chunks, merge them into the minute tables, and advance the watermark (store/watermarks.py says what it is).
The agents' summaries (samples_summary) are a queue instead: merged into samples_1m, then deleted.

The first thing a pass does; the store's maintenance also calls it, through the analyzer, before it deletes
or rewrites raw rows.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from gpuagent.collector.analysis import sql_files
from gpuagent.collector.analysis.steps import Step, rollup_steps
from gpuagent.collector.store.watermarks import rolled_up_rowid, set_watermark, watermark_of

log = logging.getLogger("gpuagent.collector.analysis.analyzer")


def rollup(con, sql: Mapping[str, list[str]], chunk_rows: int) -> int:
    """Bring samples_1m and job_samples_1m up to date; returns the raw rows read. ``sql``: each step's
    statements by step name (sql_files.load_sql)."""
    total = 0
    for step in rollup_steps():
        source = step.source
        statements = sql[step.name] + (sql[step.merge_like][1:] if step.merge_like else [])
        if step.queue:
            hi = con.execute(f"SELECT coalesce(max(rowid), -1) FROM {source}").fetchone()[0]
            total += _rollup_chunks(con, step, statements, -1, hi, chunk_rows)
            con.execute(f"DELETE FROM {source} WHERE rowid <= $hi", {"hi": hi})
            continue
        hi, count, key = watermark_of(con, source)
        lo = rolled_up_rowid(con, source, hi, count)
        if lo is None or _rowid_span(con, source, lo, hi)[2] != hi - lo:
            # Rows went that were never rolled up, or the watermark is from before this scheme: rebuild
            # the minutes the raw table still holds; older rollup minutes (past raw retention) stay.
            log.warning("rollup of %s: the watermark does not match the table; rebuilding the minutes "
                        "its raw rows cover", source)
            con.execute(f"DELETE FROM {source}_1m WHERE minute >= "
                        f"(SELECT date_trunc('minute', min(ts)) FROM {source})")
            lo = -1
        total += _rollup_chunks(con, step, statements, lo, hi, chunk_rows)
        set_watermark(con, source, hi, count, key)
    return total


def _rollup_chunks(con, step: Step, statements: list[str], lo: int, hi: int, chunk_rows: int) -> int:
    """Roll up the rows with rowid in (lo, hi] in chunks of at most ``chunk_rows`` rowids, one after
    another: a chunk's GROUP BY holds one group per minute and series of its rows, so its memory follows
    the chunk, not the backlog (a 30,000-node fleet's first hour, 72 M rows, ran out of 512 MB in one).
    The merge into the 1-minute table is exact for a minute split across chunks (10_rollup_samples.sql)."""
    total = 0
    for c_lo in range(lo, hi, chunk_rows):
        c_hi = min(hi, c_lo + chunk_rows)
        dmin, dmax, n = _rowid_span(con, step.source, c_lo, c_hi)
        if n:
            params = {"lo": c_lo, "hi": c_hi, "dmin": dmin, "dmax": dmax}
            for stmt in statements:
                sql_files.run_statement(con, stmt, params)
            total += n
    return total


def _rowid_span(con, source: str, lo: int, hi: int) -> tuple[Any, Any, int]:
    """(first minute, last minute, rows) of the rows of ``source`` with rowid in (lo, hi]."""
    dmin, dmax, n = con.execute(
        f"SELECT date_trunc('minute', min(ts)), date_trunc('minute', max(ts)), count(*) "
        f"FROM {source} WHERE rowid > $lo AND rowid <= $hi", {"lo": lo, "hi": hi}).fetchone()
    return dmin, dmax, int(n)
