"""Keeping the collector's database bounded and compact: retention, the disk guard and compaction.

Everything here runs as short calls on the writer thread (``Writer.call``), each its own transaction, so
ingest waits at most one slice between two group commits and never stops.

Raw rows are read by the analyzer's incremental rollups, whose watermark is a count of rows already rolled up
(collector/analysis/analyzer.py): it holds whatever rowids DuckDB gives the rows when a checkpoint drops or
merges row groups, as long as only rolled-up rows are deleted or rewritten. So every step that deletes or
rewrites raw rows first brings the rollups up to date, then changes the rows and re-sets the count in one
transaction: no raw row is ever rolled up twice or missed, and no step needs a checkpoint for the rollups.

What counts as the database's bytes and as room on its volume is disk_usage.py's.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuagent.collector.store.disk_usage import Usage, measure
from gpuagent.collector.store.maintenance_config import MaintenanceConfig
from gpuagent.common.background import BackgroundThread
from gpuagent.common.timeutil import utc_now

log = logging.getLogger("gpuagent.collector.store.maintenance")

HOUR = dt.timedelta(hours=1)

# table -> (time column, setting that bounds it, extra condition). Raw tables come first.
RAW_TABLES = ("samples", "job_samples")
TABLES: dict[str, tuple[str, str, str]] = {
    "samples": ("ts", "raw_retention_s", ""),
    "job_samples": ("ts", "raw_retention_s", ""),
    "samples_1m": ("minute", "rollup_retention_s", ""),
    "job_samples_1m": ("minute", "rollup_retention_s", ""),
    "probe_results": ("started_at", "probe_retention_s", ""),
    "probe_metrics": ("started_at", "probe_retention_s", ""),
    "jobs": ("last_seen", "job_retention_s", ""),
    "job_steps": ("ts", "job_retention_s", ""),
    "events": ("ts", "event_retention_s", ""),
    "flags": ("last_seen", "flag_retention_s", "state = 'closed'"),
    "link_results": ("started_at", "link_retention_s", ""),
    "group_results": ("started_at", "link_retention_s", ""),
    # raw windows a flag or a person asked for: kept as long as raw rows (docs/RESOLUTION.md)
    "raw_windows": ("ts", "raw_retention_s", ""),
    "raw_requests": ("requested_at", "raw_retention_s", ""),
}


def _table_exists(con, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'main' "
                            "AND table_name = ?", [name]).fetchone()[0])


@dataclass
class Counters:
    deleted: dict[str, int] = field(default_factory=dict)        # retention, per table
    guard_deleted: dict[str, int] = field(default_factory=dict)  # disk guard, per table
    compacted_rows: int = 0
    compacted_hours: int = 0
    compact_hold_max_s: float = 0.0     # the longest one compaction call held the writer
    compact_snapshots_renewed: int = 0  # compaction snapshots renewed because the WAL grew (compact_span)
    guard_runs: int = 0
    guard_starved: int = 0       # guard checks over the bound with nothing it may delete
    guard_freed_nothing: int = 0  # guard deletions after which the measure showed no space freed
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"deleted": dict(self.deleted), "guard_deleted": dict(self.guard_deleted),
                "compacted_rows": self.compacted_rows, "compacted_hours": self.compacted_hours,
                "compact_hold_max_s": round(self.compact_hold_max_s, 3),
                "compact_snapshots_renewed": self.compact_snapshots_renewed,
                "guard_runs": self.guard_runs, "guard_starved": self.guard_starved,
                "guard_freed_nothing": self.guard_freed_nothing,
                "last_error": self.last_error}


class Maintenance:
    """The steps, each a function of the writer's connection. ``rollup`` (the analyzer's) may be None."""

    # The write-ahead log a compaction snapshot may leave unfolded before it is renewed (``compact_span``):
    # sixteen times DuckDB's automatic checkpoint threshold.
    snapshot_wal_bytes = 256 << 20
    # ... or once this many rows were rewritten under it: until a checkpoint, the rewritten rows stay in
    # DuckDB's memory, and a 100-node 6-hour span (89 M rows) under one snapshot ran out of the default
    # 512 MB memory_limit (benchmarks/storage_efficiency.py).
    snapshot_rows = 4_000_000

    def __init__(self, db_path: str, config: MaintenanceConfig,
                 rollup: Callable[[Any], Any] | None = None,
                 now: Callable[[], dt.datetime] = utc_now):
        self.db_path = str(db_path)
        self.config = config
        self.rollup = rollup
        self.now = now
        self.counters = Counters()
        self._guard_active = False        # a disk-guard episode is deleting until under_target
        self._guard_hold_until = 0.0      # monotonic: no guard deletion before (after one freed nothing)

    # -- raw-row changes keep the rollup watermarks exact

    def _raw_change(self, con, change: Callable[[Any], Any], checkpoint: bool = True) -> Any:
        """Roll up, then ``change(con)`` and the watermark counts in one transaction; ``checkpoint`` folds the
        change into the file at once (the retention and the guard want their space back; a compaction
        chunk does not, its span checkpoints once at the end, see ``compact_span``)."""
        self._roll_up(con)
        con.execute("BEGIN TRANSACTION")
        try:
            out = change(con)
            if self.rollup is not None:
                from gpuagent.collector.store.watermarks import mark_all_rolled_up  # noqa: PLC0415

                for source in RAW_TABLES:
                    mark_all_rolled_up(con, source)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        if checkpoint:
            self._checkpoint(con, "a raw-row change")
        return out

    @staticmethod
    def _checkpoint(con, what: str) -> None:
        try:
            con.execute("CHECKPOINT")
        except Exception as exc:  # noqa: BLE001 - a reader holds a transaction; DuckDB checkpoints later
            log.info("checkpoint after %s deferred: %s", what, exc)

    def _roll_up(self, con) -> None:
        """Bring the rollups up to date in a transaction of their own."""
        if self.rollup is None:
            return
        con.execute("BEGIN TRANSACTION")
        try:
            self.rollup(con)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def _log(self, con, tbl, reason, ts_from, ts_to, rows, before=None, after=None, avail_before=None,
             avail_after=None) -> None:
        con.execute("INSERT INTO retention_log VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [utc_now(), tbl, reason, ts_from, ts_to, rows, before, after, avail_before, avail_after])

    # -- retention

    def retention_slices(self, con) -> list[tuple[str, dt.datetime, dt.datetime | None]]:
        """(table, bound, oldest) for each existing table holding rows older than its retention."""
        out = []
        now = self.now()
        for tbl, (col, setting, cond) in TABLES.items():
            if not _table_exists(con, tbl):
                continue
            bound = now - dt.timedelta(seconds=getattr(self.config, setting))
            if tbl in RAW_TABLES:   # whole minutes, so a rollup rebuild never meets a half-deleted minute
                bound = bound.replace(second=0, microsecond=0)
            where = f"WHERE {cond}" if cond else ""
            oldest = con.execute(f"SELECT min({col}) FROM {tbl} {where}").fetchone()[0]
            if oldest is not None and oldest < bound:
                out.append((tbl, bound, oldest))
        return out

    def delete_slice(self, con, tbl: str, bound: dt.datetime, oldest: dt.datetime, reason: str = "retention"
                     ) -> tuple[int, dt.datetime]:
        """Delete one slice of ``tbl`` older than ``bound`` (oldest first); returns (rows, slice end)."""
        col, _, cond = TABLES[tbl]
        end = min(bound, oldest + dt.timedelta(seconds=self.config.slice_s))
        extra = f" AND {cond}" if cond else ""

        def change(c):
            n = c.execute(f"DELETE FROM {tbl} WHERE {col} < ?{extra}", [end]).fetchone()[0]
            self._log(c, tbl, reason, None, end, int(n))
            return int(n)

        if tbl in RAW_TABLES:
            n = self._raw_change(con, change)
        else:
            con.execute("BEGIN TRANSACTION")
            try:
                n = change(con)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        self.counters.deleted[tbl] = self.counters.deleted.get(tbl, 0) + n
        return n, end

    # -- disk guard

    def over_limit(self, usage: Usage) -> bool:
        c = self.config
        return bool((c.max_db_bytes and usage.used_bytes >= c.max_db_bytes)
                    or (c.min_free_bytes and usage.available_bytes < c.min_free_bytes))

    def _exported_before(self, con, hour: dt.datetime) -> bool:
        """Lake on: the raw hour may go only once the lake holds it (part B's ``exports`` table)."""
        if not self.config.lake_enabled:
            return True
        if not _table_exists(con, "exports"):
            return False
        return bool(con.execute("SELECT count(*) FROM exports WHERE tbl = 'samples' AND hour = ?",
                                [hour]).fetchone()[0])

    def under_target(self, usage: Usage) -> bool:
        """Under the bounds by the hysteresis margin: where a guard episode stops deleting."""
        c, h = self.config, self.config.guard_hysteresis
        return bool((not c.max_db_bytes or usage.used_bytes <= c.max_db_bytes * (1 - h))
                    and (not c.min_free_bytes or usage.available_bytes >= c.min_free_bytes * (1 + h)))

    def _checkpointed_usage(self, con) -> Usage:
        """Usage after a checkpoint: the WAL's rows go into compressed blocks and deleted rows free theirs."""
        try:
            con.execute("CHECKPOINT")
        except Exception as exc:  # noqa: BLE001 - a reader holds a transaction; decide on what is measured
            log.info("disk guard: checkpoint deferred: %s", exc)
        return measure(con, self.db_path)

    def _event(self, con, kind: str, message: str, value: float, attrs: dict) -> None:
        con.execute("INSERT INTO events (ts, node_id, gpu, kind, message, value, attrs) "
                    "VALUES (?, 'collector', NULL, ?, ?, ?, ?)", [utc_now(), kind, message, value, json.dumps(attrs)])

    def guard_step(self, con) -> int:
        """One disk-guard step: delete the oldest raw hour when the measure asks for it; returns rows deleted.

        An episode starts when a bound is crossed and deletes one hour per step, measuring after a
        checkpoint before each, until the usage is under the bounds by ``guard_hysteresis``: no hour goes
        once the measure says enough has. The newest hour held is never deleted: it is what is arriving now.
        A deletion that frees no space ends the episode (an event says so) and the guard waits
        ``interval_s`` before deleting again, so an unreliable measure cannot empty the database.
        """
        if time.monotonic() < self._guard_hold_until:
            return 0
        before = measure(con, self.db_path)
        if not self._guard_active and not self.over_limit(before):
            return 0
        # The rollup writes its new minutes before the measure, so that what a deletion frees is measured
        # alone (the first rollup after hours of ingest can take more blocks than one raw hour frees).
        self._roll_up(con)
        before = self._checkpointed_usage(con)
        if self.under_target(before) or (not self._guard_active and not self.over_limit(before)):
            self._guard_active = False
            return 0
        self._guard_active = True
        oldest = con.execute("SELECT date_trunc('hour', min(ts)) FROM samples").fetchone()[0]
        jold = con.execute("SELECT date_trunc('hour', min(ts)) FROM job_samples").fetchone()[0]
        newest = con.execute("SELECT date_trunc('hour', greatest((SELECT max(ts) FROM samples), "
                             "(SELECT max(ts) FROM job_samples)))").fetchone()[0]
        hours = [h for h in (oldest, jold) if h is not None]
        if not hours or min(hours) >= newest or not self._exported_before(con, min(hours)):
            self.counters.guard_starved += 1
            self._guard_active = False
            return 0
        hour = min(hours)
        end = hour + HOUR
        self.counters.guard_runs += 1

        def change(c):
            out = {}
            for tbl in RAW_TABLES:
                out[tbl] = int(c.execute(f"DELETE FROM {tbl} WHERE ts < ?", [end]).fetchone()[0])
            return out

        deleted = self._raw_change(con, change)       # checkpoints: the freed blocks show in the measure
        after = measure(con, self.db_path)
        freed = after.available_bytes - before.available_bytes
        for tbl, n in deleted.items():
            self._log(con, tbl, "disk_guard", None, end, n, before.used_bytes, after.used_bytes,
                      before.available_bytes, after.available_bytes)
            self.counters.guard_deleted[tbl] = self.counters.guard_deleted.get(tbl, 0) + n
        attrs = {"before": end.isoformat(), "rows": deleted, "used_bytes_before": before.used_bytes,
                 "used_bytes_after": after.used_bytes, "available_bytes_before": before.available_bytes,
                 "available_bytes_after": after.available_bytes}
        self._event(con, "disk_guard", f"disk guard deleted raw rows before {end.isoformat()} "
                    f"({sum(deleted.values())} rows, {freed} bytes made available)", sum(deleted.values()), attrs)
        log.warning("disk guard: the database used %d bytes (%d available); deleted raw rows before %s: %s; "
                    "%d bytes made available", before.used_bytes, before.available_bytes, end.isoformat(), deleted,
                    freed)
        if freed <= 0 and after.used_bytes >= before.used_bytes:
            self.counters.guard_freed_nothing += 1
            self._guard_active = False
            self._guard_hold_until = time.monotonic() + self.config.interval_s
            self._event(con, "disk_guard_no_space_freed",
                        f"disk guard: deleting raw rows before {end.isoformat()} freed no space; no further "
                        f"deletion for {self.config.interval_s:.0f} s", 0.0, attrs)
            log.error("disk guard: deleting raw rows before %s freed no space; waiting %.0f s before deleting "
                      "again", end.isoformat(), self.config.interval_s)
        return sum(deleted.values())

    # -- compaction

    @property
    def span(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.config.compact_span_s)

    def closed_spans(self, con) -> list[dt.datetime]:
        """Starts of the closed compaction spans (``compact_span``, aligned to midnight) of samples not yet
        compacted, oldest first."""
        limit = self.now() - dt.timedelta(seconds=self.config.compact_grace_s)
        width = f"INTERVAL {int(self.config.compact_span_s)} SECOND"
        rows = con.execute(
            f"SELECT DISTINCT time_bucket({width}, ts, TIMESTAMP '2000-01-01') AS h FROM samples "
            f"WHERE ts < time_bucket({width}, ?::TIMESTAMP, TIMESTAMP '2000-01-01') "
            f"AND time_bucket({width}, ts, TIMESTAMP '2000-01-01') NOT IN "
            "(SELECT hour FROM compacted_hours WHERE tbl = 'samples') ORDER BY h", [limit]).fetchall()
        return [r[0] for r in rows if r[0] + self.span <= limit]

    def compact_chunk(self, con, hour: dt.datetime, node: str, metrics: list[str], rows) -> int:
        """Replace one chunk (``node``'s ``metrics`` in the span from ``hour``) by ``rows``, the same rows sorted
        by series then time, read beforehand outside the writer; one short transaction.

        Only appends happen meanwhile, so an unchanged count means unchanged rows; a late batch for the span
        makes the count differ, and the chunk is then read again here, on the writer.
        """
        end = hour + self.span
        where = "ts >= ? AND ts < ? AND node_id = ? AND metric IN (SELECT unnest(?))"
        params = [hour, end, node, metrics]

        def change(c):
            nonlocal rows
            if rows is None or c.execute(f"SELECT count(*) FROM samples WHERE {where}",
                                         params).fetchone()[0] != rows.num_rows:
                rows = c.execute(f"SELECT * FROM samples WHERE {where} ORDER BY metric, gpu, labels, ts",
                                 params).to_arrow_table()
            c.execute(f"DELETE FROM samples WHERE {where}", params)
            c.register("_compact_rows", rows)
            try:
                c.execute("INSERT INTO samples SELECT * FROM _compact_rows")
            finally:
                c.unregister("_compact_rows")
            return rows.num_rows

        t0 = time.monotonic()
        n = self._raw_change(con, change, checkpoint=False)
        self.counters.compact_hold_max_s = max(self.counters.compact_hold_max_s, time.monotonic() - t0)
        self.counters.compacted_rows += n
        return n

    def mark_compacted(self, con, hour: dt.datetime, rows: int) -> None:
        """Record the span as compacted, then the span's one checkpoint (see ``compact_span``)."""
        con.execute("INSERT OR REPLACE INTO compacted_hours VALUES ('samples', ?, ?, ?)", [hour, rows, utc_now()])
        self._log(con, "samples", "compaction", hour, hour + self.span, rows)
        self.counters.compacted_hours += 1
        t0 = time.monotonic()
        self._checkpoint(con, "a compacted span")
        self.counters.compact_hold_max_s = max(self.counters.compact_hold_max_s, time.monotonic() - t0)


def _chunks(groups: list[tuple[str, str, int]], max_rows: int) -> list[tuple[str, list[str], int]]:
    """(node, metrics, rows): consecutive whole metrics of one node, at most ``max_rows`` rows unless a
    single metric holds more (a series run is never split, so each stays one sorted run)."""
    out: list[tuple[str, list[str], int]] = []
    for node, metric, n in groups:
        if out and out[-1][0] == node and out[-1][2] + n <= max_rows:
            out[-1][1].append(metric)
            out[-1] = (node, out[-1][1], out[-1][2] + n)
        else:
            out.append((node, [metric], n))
    return out


def space_short(m: Maintenance) -> bool:
    """A cheap look, without a checkpoint, at whether the disk guard may be needed: the volume's free space
    under ``min_free_bytes`` or the file plus its WAL at ``max_db_bytes``. Compaction yields to the guard
    on it; the guard itself decides on its exact, checkpointed measure."""
    c = m.config
    wal = m.db_path + ".wal"
    try:
        vfs = os.statvfs(os.path.dirname(os.path.abspath(m.db_path)))
        size = os.path.getsize(m.db_path) + (os.path.getsize(wal) if os.path.exists(wal) else 0)
    except OSError:
        return False
    return bool((c.min_free_bytes and vfs.f_bavail * vfs.f_frsize < c.min_free_bytes)
                or (c.max_db_bytes and size >= c.max_db_bytes))


def compact_span(call: Callable[[Callable[[Any], Any]], Any], m: Maintenance, hour: dt.datetime,
                 stop: threading.Event | None = None) -> int:
    """Compact one closed span through ``call``: one writer call per chunk of whole (node, metric) groups
    (``compact_chunk_rows``), each chunk read and sorted beforehand on a reading connection, and a pause
    after each chunk so compaction takes at most ``compact_duty`` of the time (ingest goes between).

    The reading connection holds one transaction (snapshot) across the chunks. Each chunk deletes a share
    of every row group of the span (they hold all nodes, in arrival order), and a checkpoint in between
    would have DuckDB vacuum, that is rewrite, those row groups again and again, holding the writer for
    seconds; DuckDB does not vacuum rows an open snapshot may still read. After the last chunk the
    span's row groups hold deleted rows only and the span's one checkpoint drops them whole. While a
    snapshot is open DuckDB also folds no write-ahead log written by a transaction that updated rows
    (ingest updates nodes.last_seen), and the rewritten rows stay in memory, so once the log passes
    ``Maintenance.snapshot_wal_bytes`` or ``snapshot_rows`` rows were rewritten under it, the
    snapshot is renewed between two chunks, and the next checkpoint vacuums what the chunks so far left."""
    end = hour + m.span
    wal = m.db_path + ".wal"
    reader = call(lambda c: c.cursor())
    try:
        reader.execute("BEGIN TRANSACTION")
        groups = reader.execute("SELECT node_id, metric, count(*) FROM samples WHERE ts >= ? AND ts < ? "
                                "GROUP BY ALL ORDER BY 1, 2", [hour, end]).fetchall()
        total = rows_at_renewal = 0
        duty = m.config.compact_duty
        for node, metrics, _ in _chunks(groups, m.config.compact_chunk_rows):
            if (stop is not None and stop.is_set()) or space_short(m):
                # Not marked: the next pass does the span again, which only re-sorts. When space is short the
                # guard runs first (same thread): a span of a large fleet can take minutes to compact.
                return total
            if ((os.stat(wal).st_size if os.path.exists(wal) else 0) > m.snapshot_wal_bytes
                    or total - rows_at_renewal > m.snapshot_rows):
                reader.execute("COMMIT")
                # Fold what this snapshot held back into the file now (it vacuums the span's row groups
                # once), rather than at some later group commit.
                call(lambda c: m._checkpoint(c, "a compaction snapshot"))
                reader.execute("BEGIN TRANSACTION")
                rows_at_renewal = total
                m.counters.compact_snapshots_renewed += 1
            t0 = time.monotonic()
            rows = reader.execute("SELECT * FROM samples WHERE ts >= ? AND ts < ? AND node_id = ? AND metric IN "
                                  "(SELECT unnest(?)) ORDER BY metric, gpu, labels, ts",
                                  [hour, end, node, metrics]).to_arrow_table()
            total += call(lambda c, n=node, ms=metrics, r=rows: m.compact_chunk(c, hour, n, ms, r))
            del rows
            if duty < 1.0:
                pause = (time.monotonic() - t0) * (1.0 - duty) / duty
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)
    finally:
        reader.close()     # ends the snapshot
    call(lambda c: m.mark_compacted(c, hour, total))
    return total


def run_retention(call: Callable[[Callable[[Any], Any]], Any], m: Maintenance,
                  stop: threading.Event | None = None) -> dict[str, int]:
    """Every table down to its retention, one slice per writer call; returns rows deleted per table."""
    out: dict[str, int] = {}
    for tbl, bound, oldest in call(m.retention_slices):
        while oldest is not None and oldest < bound and not (stop and stop.is_set()):
            n, end = call(lambda c, t=tbl, b=bound, o=oldest: m.delete_slice(c, t, b, o))
            out[tbl] = out.get(tbl, 0) + n
            col, _, cond = TABLES[tbl]
            where = f"WHERE {cond}" if cond else ""
            oldest = call(lambda c, t=tbl, col=col, w=where: c.execute(f"SELECT min({col}) FROM {t} {w}")
                          .fetchone()[0])
            if oldest is not None and oldest < end:    # rows at the slice end itself are kept: move past
                break
    return out


def run_guard(call: Callable[[Callable[[Any], Any]], Any], m: Maintenance, max_steps: int = 1000) -> int:
    """Disk-guard steps until under the bounds or nothing more may go; returns rows deleted."""
    total = 0
    for _ in range(max_steps):
        n = call(m.guard_step)
        if not n:
            break
        total += n
    return total


class MaintenanceThread:
    """Runs the disk guard every ``guard_interval_s`` and retention + compaction every ``interval_s``."""

    def __init__(self, m: Maintenance, call: Callable[[Callable[[Any], Any]], Any]):
        self.m = m
        self._call = call
        self._worker = BackgroundThread("gpuagent-maintenance", self._loop)
        self._stop = self._worker.stopping

    def start(self) -> "MaintenanceThread":
        self._worker.start()
        return self

    def _loop(self) -> None:
        next_full = time.monotonic() + min(self.m.config.interval_s, 10.0)
        while not self._stop.wait(self.m.config.guard_interval_s):
            try:
                run_guard(self._call, self.m)
                if time.monotonic() >= next_full:
                    next_full = time.monotonic() + self.m.config.interval_s
                    run_retention(self._call, self.m, self._stop)
                    if self.m.config.compaction:
                        for hour in self._call(self.m.closed_spans):
                            if self._stop.is_set():
                                break
                            compact_span(self._call, self.m, hour, self._stop)
                self.m.counters.last_error = None
            except Exception as exc:  # noqa: BLE001 - keep ingesting; try again next interval
                self.m.counters.last_error = str(exc)
                log.error("storage maintenance failed: %s", exc)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)
