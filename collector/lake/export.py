"""Exporting closed hours of the collector's tables to the Parquet lake (layout: lake/layout.py, docs/LAKE.md).

An hour is *closed* once it ended ``grace`` ago (late batches land in the grace). Each closed hour of each
hourly table is written once per shard as ZSTD Parquet sorted by series then time, and recorded in the
``exports`` table; the snapshots (nodes, gpus, flags) are rewritten on every run. Reads go through a reader
cursor, so ingest never waits on a long export; only the ``exports`` row goes through the writer.

Crash safety: files are written under ``_tmp/<shard>/<run>/`` and the finished partition is renamed into
place (local filesystems), or written in place with its ``_SUCCESS`` manifest last (object stores). The
``exports`` row is written after that, so a killed collector either left nothing readers can see (the next
run exports the hour) or a complete partition not yet recorded (the next run replaces it with the same rows).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gpuagent.collector.config_file import CollectorConfigError, duration
from gpuagent.collector.lake import layout
from gpuagent.collector.lake.layout import Lake, LakeError
from gpuagent.common.background import BackgroundThread
from gpuagent.common.errors import first_line
from gpuagent.common.timeutil import utc_now

log = logging.getLogger("gpuagent.collector.lake")

# A test hook, read only here: seconds to pause after a partition's files are written and before it is put
# in place, so a test can kill the collector in the middle of an export.
PAUSE_ENV = "GPUAGENT_LAKE_TEST_PAUSE_S"
ROWS_PER_BATCH = 1_000_000


@dataclass(frozen=True)
class HourlyTable:
    name: str
    time_col: str
    order_by: str


HOURLY: tuple[HourlyTable, ...] = (
    HourlyTable("samples", "ts", "node_id, metric, gpu, labels, ts"),
    HourlyTable("samples_1m", "minute", "node_id, metric, gpu, labels, minute"),
    HourlyTable("probe_results", "started_at", "node_id, probe, gpu, params_key, started_at"),
    HourlyTable("probe_metrics", "started_at", "node_id, probe, metric, gpu, params_key, started_at"),
    HourlyTable("job_samples", "ts", "node_id, job_id, gpu, ts"),
    HourlyTable("job_steps", "ts", "node_id, job_id, rank, ts"),
    HourlyTable("events", "ts", "node_id, kind, ts"),
    HourlyTable("link_results", "started_at", "node_a, node_b, probe, started_at"),
    HourlyTable("group_results", "started_at", "members, probe, started_at"),
)
# Rewritten whole on every run: small, and their rows change (a node's last_seen, a flag closing).
# UBIGINT columns become BIGINT: Spark reads no unsigned 64-bit Parquet type.
SNAPSHOTS: Mapping[str, str] = {
    "nodes": "SELECT * REPLACE (CAST(memory_total_bytes AS BIGINT) AS memory_total_bytes) FROM nodes "
             "ORDER BY node_id",
    "gpus": "SELECT * REPLACE (CAST(memory_total_bytes AS BIGINT) AS memory_total_bytes) FROM gpus "
            "ORDER BY node_id, gpu",
    "flags": "SELECT * FROM flags ORDER BY flag_id",
}
TABLES = tuple(t.name for t in HOURLY) + tuple(SNAPSHOTS)


# ------------------------------------------------------------------------------------------ config

@dataclass(frozen=True)
class LakeConfig:
    """The collector's ``[lake]`` section; a bad value is a ``CollectorConfigError`` naming the key."""

    enabled: bool = False
    path: str | None = None
    shard: str = ""               # empty: this host's name
    interval_s: float = 300.0
    grace_s: float = 600.0
    fleet_baselines: bool = False  # take fleet_baselines from the lake (`lake baselines`) instead of this shard

    @property
    def shard_name(self) -> str:
        return self.shard or socket.gethostname().split(".")[0]

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any]) -> "LakeConfig":
        section = doc.get("lake") or {}
        if not isinstance(section, Mapping):
            raise CollectorConfigError("[lake] in the collector config must be a table")
        known = {"enabled", "path", "shard", "interval", "grace", "fleet_baselines"}
        extra = sorted(set(section) - known)
        if extra:
            raise CollectorConfigError(f"unknown [lake] setting {extra[0]!r} (known: {', '.join(sorted(known))})")
        kw: dict[str, Any] = {}
        for key in ("enabled", "fleet_baselines"):
            if key in section:
                if not isinstance(section[key], bool):
                    raise CollectorConfigError(f"[lake] {key} must be true or false, not {section[key]!r}")
                kw[key] = section[key]
        for key in ("path", "shard"):
            if key in section:
                if not isinstance(section[key], str):
                    raise CollectorConfigError(f"[lake] {key} must be text, not {section[key]!r}")
                kw[key] = section[key]
        for key in ("interval", "grace"):
            if key in section:
                kw[f"{key}_s"] = duration("lake", key, section[key])
        cfg = cls(**kw)
        if (cfg.enabled or cfg.fleet_baselines) and not cfg.path:
            raise CollectorConfigError("[lake] needs path = \"/folder\" or \"s3://bucket/prefix\" when enabled or "
                                       "fleet_baselines is on")
        if cfg.interval_s <= 0:
            raise CollectorConfigError("[lake] interval must be positive")
        if cfg.shard:
            try:
                layout.check_shard(cfg.shard)
            except LakeError as exc:
                raise CollectorConfigError(f"[lake] shard: {exc}") from None
        return cfg

# ------------------------------------------------------------------------------------------ exporter

@dataclass
class ExportResult:
    partitions: int = 0
    rows: int = 0
    bytes: int = 0
    snapshots: int = 0
    skipped_not_rolled_up: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _encodings(schema: pa.Schema, time_col: str | None) -> dict[str, Any]:
    """Parquet encodings for rows sorted by series then time. The time column is delta-encoded (a series'
    timestamps are nearly evenly spaced, so its deltas pack to a few bits); floating-point columns are
    stored plain, since measured values rarely repeat and zstd compresses their bytes better than a
    dictionary does (on the simulator's fleet: 2.2 instead of 3.0 bytes per sample); everything else keeps a
    dictionary. All three are standard Parquet encodings that Spark, Trino, DuckDB and pandas read."""
    delta = {time_col} if time_col and pa.types.is_timestamp(schema.field(time_col).type) else set()
    plain = {f.name for f in schema if pa.types.is_floating(f.type)}
    return {"use_dictionary": [f.name for f in schema if f.name not in delta | plain],
            "column_encoding": {**{c: "DELTA_BINARY_PACKED" for c in delta}, **{c: "PLAIN" for c in plain}}}


def _hour_start(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _rolled_up_rowid(cur) -> int | None:
    """The highest rowid of samples already rolled up into samples_1m, in ``cur``'s snapshot; None when no
    rollup ran yet or its watermark does not match the table (the next pass rebuilds)."""
    from gpuagent.collector.store.watermarks import rolled_up_rowid  # noqa: PLC0415

    if not cur.execute("SELECT count(*) FROM rollup_watermarks WHERE source = 'samples'").fetchone()[0]:
        return None
    hi, count = cur.execute("SELECT max(rowid), count(*) FROM samples").fetchone()
    hi = -1 if hi is None else int(hi)
    lo = rolled_up_rowid(cur, "samples", hi, int(count))
    if lo is None or cur.execute("SELECT count(*) FROM samples WHERE rowid > ?", [lo]).fetchone()[0] != hi - lo:
        return None
    return lo


class Exporter:
    """Exports one collector database's closed hours to a lake under one shard name.

    ``cursor()`` gives a connection or cursor to read from; ``write(fn)`` runs ``fn(con)`` where the
    database may be written (the collector's writer thread, or the only connection of an offline file).
    """

    def __init__(self, lake: Lake, shard: str, cursor: Callable[[], Any], write: Callable[[Callable], Any],
                 grace_s: float = 600.0):
        self.lake = lake
        self.shard = layout.check_shard(shard)
        self._cursor = cursor
        self._write = write
        self.grace_s = grace_s
        self.totals = ExportResult()

    # -- what to export

    def pending(self, now: dt.datetime, again: bool = False) -> list[tuple[HourlyTable, dt.datetime]]:
        """(table, hour) pairs that are closed at ``now`` and not yet exported by this shard."""
        closed_before = _hour_start(now - dt.timedelta(seconds=self.grace_s))
        cur = self._cursor()
        cur.execute("BEGIN TRANSACTION")     # one snapshot: a checkpoint between two reads may renumber rowids
        try:
            done = set() if again else {
                (t, h) for t, h in cur.execute("SELECT tbl, hour FROM exports WHERE shard = ?",
                                               [self.shard]).fetchall()}
            rolled = _rolled_up_rowid(cur)
            # hours that agents' summaries still wait to be merged into (docs/RESOLUTION.md)
            queued = {h for (h,) in cur.execute("SELECT DISTINCT date_trunc('hour', ts) FROM samples_summary")
                      .fetchall()}
            out = []
            for t in HOURLY:
                if t.name == "samples_1m":
                    continue
                rows = cur.execute(
                    f"SELECT date_trunc('hour', {t.time_col}) AS h, max(rowid) FROM {t.name} "
                    f"WHERE {t.time_col} < ? GROUP BY h ORDER BY h", [closed_before]).fetchall()
                for h, max_rowid in rows:
                    if (t.name, h) not in done:
                        out.append((t, h))
                    if t.name == "samples" and ("samples_1m", h) not in done:
                        # The rollup of an hour is complete once every raw row and summary of it is rolled up.
                        if rolled is not None and int(max_rowid) <= rolled and h not in queued:
                            out.append((HOURLY[1], h))
                        else:
                            self.totals.skipped_not_rolled_up += 1
        finally:
            cur.execute("COMMIT")
        return out

    # -- one partition

    def _put(self, partition: str, batches, run: str, time_col: str | None = None) -> tuple[int, int]:
        """Write ``batches`` (an Arrow RecordBatchReader) as ``partition``; returns (rows, bytes)."""
        fs = self.lake.fs
        atomic = self.lake.renames_atomically
        tmp_root = self.lake.path(layout.TMP, self.shard, run)
        where = f"{tmp_root}/{partition}" if atomic else self.lake.path(partition)
        fs.create_dir(where, recursive=True)
        name = f"part-{run}-0.parquet"
        rows = 0
        with fs.open_output_stream(f"{where}/{name}") as sink:
            writer = pq.ParquetWriter(sink, batches.schema, compression="zstd", write_statistics=True,
                                      **_encodings(batches.schema, time_col))
            try:
                for batch in batches:
                    if batch.num_rows:
                        writer.write_batch(batch)
                        rows += batch.num_rows
            finally:
                writer.close()
        size = fs.get_file_info(f"{where}/{name}").size or 0
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause > 0:
            time.sleep(pause)
        if atomic:
            with fs.open_output_stream(f"{where}/{layout.SUCCESS}") as fh:
                fh.write(f"{name}\n".encode())
            final = self.lake.path(partition)
            old = f"{tmp_root}-replaced"
            if fs.get_file_info(final).type != pafs.FileType.NotFound:
                fs.move(final, old)
            else:
                fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
            fs.move(where, final)
            if fs.get_file_info(old).type != pafs.FileType.NotFound:
                fs.delete_dir(old)
            fs.delete_dir(tmp_root)
        else:
            # The manifest is one object written last: readers switch from the old files to the new at once.
            with fs.open_output_stream(f"{where}/{layout.SUCCESS}") as fh:
                fh.write(f"{name}\n".encode())
            for info in fs.get_file_info(pafs.FileSelector(where)):
                if info.type == pafs.FileType.File and info.base_name not in (name, layout.SUCCESS):
                    fs.delete_file(info.path)
        return rows, size

    def export_hour(self, table: HourlyTable, hour: dt.datetime) -> tuple[int, int]:
        """Export (or export again, replacing it) one hour of one table; returns (rows, bytes)."""
        partition = layout.hour_partition(table.name, hour.strftime("%Y-%m-%d"), hour.hour, self.shard)
        run = f"{utc_now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        # An existing row would claim the hour while the old partition is being swapped out.
        self._write(lambda con: con.execute("DELETE FROM exports WHERE tbl = ? AND hour = ? AND shard = ?",
                                            [table.name, hour, self.shard]))
        cur = self._cursor()
        reader = cur.execute(
            f"SELECT * FROM {table.name} WHERE {table.time_col} >= ? AND {table.time_col} < ? "
            f"ORDER BY {table.order_by}", [hour, hour + dt.timedelta(hours=1)]).to_arrow_reader(ROWS_PER_BATCH)
        rows, size = self._put(partition, reader, run, table.time_col)
        path = self.lake.uri_of(partition)
        self._write(lambda con: con.execute(
            "INSERT OR REPLACE INTO exports VALUES (?, ?, ?, ?, ?, ?, ?)",
            [table.name, hour, self.shard, rows, size, path, utc_now()]))
        return rows, size

    def export_snapshots(self) -> int:
        run = f"{utc_now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        for name, sql in SNAPSHOTS.items():
            reader = self._cursor().execute(sql).to_arrow_reader(ROWS_PER_BATCH)
            self._put(layout.snapshot_partition(name, self.shard), reader, f"{run}-{name}")
        return len(SNAPSHOTS)

    # -- a run

    def clean_tmp(self) -> None:
        """Drop what an interrupted run of this shard left under _tmp (never read by anyone)."""
        where = self.lake.path(layout.TMP, self.shard)
        if self.lake.fs.get_file_info(where).type == pafs.FileType.Directory:
            self.lake.fs.delete_dir(where)

    def run_once(self, now: dt.datetime | None = None, again: bool = False) -> ExportResult:
        now = now or utc_now()
        result = ExportResult()
        todo = self.pending(now, again)
        for table, hour in todo:
            rows, size = self.export_hour(table, hour)
            result.partitions += 1
            result.rows += rows
            result.bytes += size
        result.snapshots = self.export_snapshots()
        result.skipped_not_rolled_up = self.totals.skipped_not_rolled_up
        self.totals.partitions += result.partitions
        self.totals.rows += result.rows
        self.totals.bytes += result.bytes
        return result


class ExporterThread:
    """Runs ``exporter.run_once`` every ``interval_s`` until stopped; errors are logged, ingest goes on."""

    def __init__(self, exporter: Exporter, interval_s: float):
        self.exporter = exporter
        self.interval_s = interval_s
        self.last_error: str | None = None
        self.runs = 0
        self._worker = BackgroundThread("gpuagent-lake-export", self._loop)
        self._stop = self._worker.stopping

    def start(self) -> "ExporterThread":
        self._worker.start()
        return self

    def _loop(self) -> None:
        try:
            self.exporter.clean_tmp()
        except OSError as exc:
            log.error("lake: cannot clean %s: %s", layout.TMP, first_line(exc))
        while True:
            try:
                res = self.exporter.run_once()
                self.runs += 1
                self.last_error = None
                if res.partitions:
                    log.info("lake: exported %d partitions (%d rows, %d bytes) to %s as shard %s",
                             res.partitions, res.rows, res.bytes, self.exporter.lake.uri, self.exporter.shard)
            except Exception as exc:  # noqa: BLE001 - the next run retries; ingest must go on
                self.last_error = first_line(exc)
                log.error("lake export failed (retried in %g s): %s", self.interval_s, self.last_error)
            if self._stop.wait(self.interval_s):
                return

    def stop(self, timeout: float = 60.0) -> None:
        self._worker.stop(timeout)


def export_db(db_path: str, lake_uri: str, shard: str, grace_s: float = 600.0, again: bool = False,
              now: dt.datetime | None = None) -> ExportResult:
    """Export a database file no collector holds (``gpuagent-collector lake export``)."""
    from gpuagent.collector.store import db  # noqa: PLC0415

    if not os.path.exists(db_path):
        raise LakeError(f"database {db_path} does not exist")
    lake = layout.open_lake(lake_uri, create=True)
    try:
        con = db.open_database(db_path)
    except db.DatabaseError as exc:
        raise LakeError(str(exc)) from None
    try:
        exporter = Exporter(lake, shard, con.cursor, lambda fn: fn(con), grace_s)
        exporter.clean_tmp()
        return exporter.run_once(now, again)
    finally:
        con.close()
