"""The only code that writes to the collector's DuckDB file.

One thread owns one DuckDB connection. gRPC handlers validate a batch and turn it into Arrow
columns (``prepare_batch``), then hand it to the writer's queue. The writer takes whatever has
queued up (group commit: many batches, many streams, one transaction), inserts each table's rows
through Arrow in bulk, records every (node_id, seq) in ``ingest_log`` and commits. Only then does it
call each batch's callback with the Ack. A (node_id, seq) already in ``ingest_log`` is acked with
``duplicate=True`` and nothing of it is stored, so at-least-once delivery stores exactly once.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import duckdb
import numpy as np
import pyarrow as pa

from gpuagent.proto import pb

log = logging.getLogger("gpuagent.collector.store.writer")

# Timestamps before 2000-01-01 are certainly a unit mistake (seconds or ms sent as ns).
MIN_TS_NS = 946_684_800 * 1_000_000_000
MAX_SEQ = 2**63 - 1     # seqs are stored as UBIGINT but exported to Parquet/Spark, which have no unsigned type
PROBE_STATUSES = frozenset({"ok", "skipped", "failed", "timeout"})


class BatchError(Exception):
    """A batch that must be refused as a whole. ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StorageError(RuntimeError):
    """The database could not store a batch (disk full, I/O error, ...)."""


@dataclass(frozen=True)
class Limits:
    max_samples_per_batch: int = 1_000_000
    max_rows_per_batch: int = 100_000       # probe results + job samples + job steps + events
    max_series_per_batch: int = 100_000     # entries of the batch's series dictionary
    max_future_s: float = 86_400.0          # a timestamp may run ahead of the collector clock by this


@dataclass
class PreparedBatch:
    """A validated batch turned into Arrow tables, ready for the writer."""

    node_id: str
    seq: int
    n_samples: int
    samples: pa.Table | None
    probe_results: pa.Table | None
    probe_metrics: pa.Table | None
    job_samples: pa.Table | None
    job_steps: pa.Table | None
    events: pa.Table | None
    job_seen: pa.Table | None
    job_end: pa.Table | None
    counts: tuple[int, int, int, int, int]


def _ts_type() -> pa.DataType:
    return pa.timestamp("ns")


_LABEL_ESCAPES = str.maketrans({"\\": "\\\\", ",": "\\,", "=": "\\="})


def labels_text(labels) -> str:
    """The stored form of a label set: ``k=v,k2=v2`` sorted by key, '' when empty.

    Backslash, comma and equals sign inside keys and values are escaped with a backslash, so two different
    label sets never give the same text ({a: "1,b=2"} is ``a=1\\,b\\=2``; {a: "1", b: "2"} is ``a=1,b=2``)."""
    if not labels:
        return ""
    esc = _LABEL_ESCAPES
    return ",".join(f"{str(k).translate(esc)}={str(labels[k]).translate(esc)}" for k in sorted(labels))


def _json(mapping) -> str:
    return json.dumps(dict(mapping), sort_keys=True, separators=(",", ":"))


GPU_MAX = 32767      # the gpu columns are SMALLINT


def _gpu_or_none(g: int) -> int | None:
    if g > GPU_MAX:
        raise BatchError("INVALID_ARGUMENT", f"gpu index {g} is out of range (at most {GPU_MAX})")
    return None if g < 0 else g


def _check_ts(name: str, lo: int, hi: int, max_ts: int) -> None:
    if lo < MIN_TS_NS or hi > max_ts:
        bad = lo if lo < MIN_TS_NS else hi
        raise BatchError("INVALID_ARGUMENT",
                         f"{name} {bad} is not a plausible Unix time in nanoseconds "
                         f"(must lie between 2000-01-01 and the collector's clock plus the allowed skew)")


def _job_end_time(e, key: str, max_ts: int) -> int | None:
    """One of a job_end event's wall-clock ns attrs (started_ns, first_seen_ns, last_seen_ns), or None
    when the agent did not send it (older agents)."""
    raw = e.attrs.get(key)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BatchError("INVALID_ARGUMENT",
                         f"job_end event of job {e.attrs['job_id']!r} has a non-integer {key} {raw!r}") from None
    if value < MIN_TS_NS or value > max_ts:
        raise BatchError("INVALID_ARGUMENT",
                         f"job_end event of job {e.attrs['job_id']!r} has {key} {value}, not a plausible Unix "
                         f"time in nanoseconds (must lie between 2000-01-01 and the collector's clock plus "
                         f"the allowed skew)")
    return value


def _samples_table(node_id: str, cols: pb.SampleColumns, max_ts: int) -> pa.Table | None:
    n = len(cols.ts_ns)
    if len(cols.series_id) != n or len(cols.value) != n:
        raise BatchError("INVALID_ARGUMENT",
                         f"samples arrays differ in length: ts_ns={n}, series_id={len(cols.series_id)}, "
                         f"value={len(cols.value)}")
    if n == 0:
        return None
    series = cols.series
    if not series:
        raise BatchError("INVALID_ARGUMENT", f"{n} samples but the batch defines no series")
    ids = np.fromiter((s.id for s in series), dtype=np.int64, count=len(series))
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    if len(sorted_ids) > 1 and bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
        raise BatchError("INVALID_ARGUMENT", "the series dictionary defines the same series id twice")
    metrics = [s.metric for s in series]
    gpus = [s.gpu for s in series]
    labels = [labels_text(s.labels) for s in series]
    if not all(metrics):
        raise BatchError("INVALID_ARGUMENT", f"series {series[metrics.index('')].id} has an empty metric name")
    if min(gpus) < -1:
        bad = next(s for s in series if s.gpu < -1)
        raise BatchError("INVALID_ARGUMENT", f"series {bad.id} has gpu index {bad.gpu} (use -1 for host-level)")
    if max(gpus) > GPU_MAX:
        bad = next(s for s in series if s.gpu > GPU_MAX)
        raise BatchError("INVALID_ARGUMENT", f"series {bad.id} has gpu index {bad.gpu}, out of range (at most {GPU_MAX})")

    # The protobuf containers expose __array__, so these are C-speed copies, not Python loops.
    ts = np.asarray(cols.ts_ns, dtype=np.int64)
    sid = np.asarray(cols.series_id, dtype=np.int64)
    values = np.asarray(cols.value, dtype=np.float64)
    _check_ts("sample ts_ns", int(ts.min()), int(ts.max()), max_ts)

    where = np.searchsorted(sorted_ids, sid)
    where_clipped = np.minimum(where, len(sorted_ids) - 1)
    unknown = sorted_ids[where_clipped] != sid
    if bool(unknown.any()):
        bad = int(sid[np.argmax(unknown)])
        raise BatchError("INVALID_ARGUMENT", f"sample refers to series id {bad}, which the batch does not define")
    pos = order[where_clipped].astype(np.int32)

    gpu_per_series = np.asarray(gpus, dtype=np.int16)
    gpu = gpu_per_series[pos]
    gpu_mask = gpu < 0
    nan_mask = np.isnan(values)
    return pa.table({
        "ts": pa.Array.from_buffers(_ts_type(), n, [None, pa.py_buffer(ts)]),
        "node_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([node_id])),
        "gpu": pa.array(gpu, mask=gpu_mask if gpu_mask.any() else None),
        "metric": pa.DictionaryArray.from_arrays(pa.array(pos), pa.array(metrics, pa.string())),
        "labels": pa.DictionaryArray.from_arrays(pa.array(pos), pa.array(labels, pa.string())),
        "value": pa.array(values, mask=nan_mask if nan_mask.any() else None),
    })


def _table(rows: dict[str, list], types: dict[str, pa.DataType]) -> pa.Table:
    return pa.table({name: pa.array(vals, types[name]) for name, vals in rows.items()})


def prepare_batch(batch: pb.Batch, limits: Limits = Limits(), now_ns: int | None = None) -> PreparedBatch:
    """Validate ``batch`` completely and build its Arrow tables; raise BatchError on anything wrong.

    Runs in the gRPC handler (not the writer thread) so validation and conversion overlap with commits.
    """
    if not batch.node_id:
        raise BatchError("INVALID_ARGUMENT", "batch has no node_id (call Register first)")
    if not 1 <= batch.seq <= MAX_SEQ:
        raise BatchError("INVALID_ARGUMENT", f"batch seq {batch.seq} is out of range: seq must be 1 or more and at "
                                             f"most 2^63-1 ({MAX_SEQ}), the signed 64-bit range every reader of "
                                             "the store has")
    n_samples = len(batch.samples.ts_ns)
    if n_samples > limits.max_samples_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch has {n_samples} samples, over the collector's limit of "
                         f"{limits.max_samples_per_batch} per batch; send smaller batches")
    n_series = len(batch.samples.series)
    if n_series > limits.max_series_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch defines {n_series} series, over the collector's limit of "
                         f"{limits.max_series_per_batch} per batch; send smaller batches")
    n_rows = len(batch.probe_results) + len(batch.job_samples) + len(batch.job_steps) + len(batch.events)
    if n_rows > limits.max_rows_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch has {n_rows} probe/job/event rows, over the collector's limit of "
                         f"{limits.max_rows_per_batch} per batch; send smaller batches")
    now_ns = time.time_ns() if now_ns is None else now_ns
    max_ts = now_ns + int(limits.max_future_s * 1e9)
    node_id = batch.node_id

    samples = _samples_table(node_id, batch.samples, max_ts)

    probe_results = probe_metrics = None
    if batch.probe_results:
        pr = {k: [] for k in ("node_id", "probe", "gpu", "status", "reason", "params", "params_key",
                              "env", "started_at", "ended_at", "duration_s")}
        pm = {k: [] for k in ("node_id", "probe", "gpu", "params_key", "started_at", "metric", "value")}
        for r in batch.probe_results:
            if not r.probe:
                raise BatchError("INVALID_ARGUMENT", "probe result without a probe name")
            if r.status not in PROBE_STATUSES:
                raise BatchError("INVALID_ARGUMENT",
                                 f"probe {r.probe!r} has status {r.status!r}; expected one of "
                                 f"{', '.join(sorted(PROBE_STATUSES))}")
            # A result without times (e.g. a probe that failed before it started) takes the other time,
            # else the batch's creation time, rather than costing the whole batch.
            started = r.started_ns or r.ended_ns or batch.created_ns
            ended = r.ended_ns or started
            _check_ts(f"probe {r.probe!r} started_ns", started, started, max_ts)
            if ended < started:
                raise BatchError("INVALID_ARGUMENT", f"probe {r.probe!r} ended before it started")
            _check_ts(f"probe {r.probe!r} ended_ns", ended, ended, max_ts)
            key = labels_text(r.params)
            gpu = _gpu_or_none(r.gpu)
            pr["node_id"].append(node_id)
            pr["probe"].append(r.probe)
            pr["gpu"].append(gpu)
            pr["status"].append(r.status)
            pr["reason"].append(r.reason or None)
            pr["params"].append(_json(r.params))
            pr["params_key"].append(key)
            pr["env"].append(_json(r.env))
            pr["started_at"].append(started)
            pr["ended_at"].append(ended)
            pr["duration_s"].append((ended - started) / 1e9)
            for metric in sorted(r.metrics):
                pm["node_id"].append(node_id)
                pm["probe"].append(r.probe)
                pm["gpu"].append(gpu)
                pm["params_key"].append(key)
                pm["started_at"].append(started)
                pm["metric"].append(metric)
                value = r.metrics[metric]
                pm["value"].append(value if value == value else None)   # NaN: not measured
        ts, s, i16, f64 = _ts_type(), pa.string(), pa.int16(), pa.float64()
        probe_results = _table(pr, {"node_id": s, "probe": s, "gpu": i16, "status": s, "reason": s,
                                    "params": s, "params_key": s, "env": s, "started_at": ts,
                                    "ended_at": ts, "duration_s": f64})
        probe_metrics = _table(pm, {"node_id": s, "probe": s, "gpu": i16, "params_key": s,
                                    "started_at": ts, "metric": s, "value": f64}) if pm["metric"] else None

    seen = {"node_id": [], "job_id": [], "ts": [], "job_name": [], "source": [], "world_size": []}
    job_samples = None
    if batch.job_samples:
        cols = {k: [] for k in ("ts", "node_id", "job_id", "pid", "rank", "local_rank", "gpu",
                                "gpu_util_percent", "gpu_memory_bytes", "cpu_percent", "rss_bytes",
                                "read_bytes_per_s", "write_bytes_per_s")}
        for j in batch.job_samples:
            if not j.job_id:
                raise BatchError("INVALID_ARGUMENT", "job sample without a job_id")
            _check_ts(f"job sample ts_ns ({j.job_id})", j.ts_ns, j.ts_ns, max_ts)
            cols["ts"].append(j.ts_ns)
            cols["node_id"].append(node_id)
            cols["job_id"].append(j.job_id)
            cols["pid"].append(j.pid)
            cols["rank"].append(j.rank if j.rank >= 0 else None)
            cols["local_rank"].append(j.local_rank if j.local_rank >= 0 else None)
            cols["gpu"].append(_gpu_or_none(j.gpu))
            cols["gpu_util_percent"].append(j.gpu_util_percent)
            cols["gpu_memory_bytes"].append(j.gpu_memory_bytes)
            cols["cpu_percent"].append(j.cpu_percent)
            cols["rss_bytes"].append(j.rss_bytes)
            cols["read_bytes_per_s"].append(j.read_bytes_per_s)
            cols["write_bytes_per_s"].append(j.write_bytes_per_s)
            seen["node_id"].append(node_id)
            seen["job_id"].append(j.job_id)
            seen["ts"].append(j.ts_ns)
            seen["job_name"].append(j.job_name or None)
            seen["source"].append(j.source or None)
            seen["world_size"].append(j.world_size if j.world_size > 0 else None)
        f64, i32 = pa.float64(), pa.int32()
        job_samples = _table(cols, {"ts": _ts_type(), "node_id": pa.string(), "job_id": pa.string(),
                                    "pid": i32, "rank": i32, "local_rank": i32, "gpu": pa.int16(),
                                    "gpu_util_percent": f64, "gpu_memory_bytes": f64, "cpu_percent": f64,
                                    "rss_bytes": f64, "read_bytes_per_s": f64, "write_bytes_per_s": f64})

    job_steps = None
    if batch.job_steps:
        names = ("ts", "node_id", "job_id", "job_name", "rank", "pid", "window_s", "steps",
                 "step_time_p50_s", "step_time_p95_s", "step_time_max_s", "step_time_mean_s",
                 "steps_per_s", "samples_per_s", "tokens_per_s", "data_wait_fraction")
        cols = {k: [] for k in names}
        for j in batch.job_steps:
            if not j.job_id:
                raise BatchError("INVALID_ARGUMENT", "job step without a job_id")
            _check_ts(f"job step ts_ns ({j.job_id})", j.ts_ns, j.ts_ns, max_ts)
            cols["ts"].append(j.ts_ns)
            cols["node_id"].append(node_id)
            cols["job_id"].append(j.job_id)
            cols["job_name"].append(j.job_name or None)
            cols["rank"].append(j.rank if j.rank >= 0 else None)
            cols["pid"].append(j.pid)
            cols["window_s"].append(j.window_s)
            cols["steps"].append(j.steps)
            cols["step_time_p50_s"].append(j.step_time_p50_s)
            cols["step_time_p95_s"].append(j.step_time_p95_s)
            cols["step_time_max_s"].append(j.step_time_max_s)
            cols["step_time_mean_s"].append(j.step_time_mean_s)
            cols["steps_per_s"].append(j.steps_per_s)
            cols["samples_per_s"].append(j.samples_per_s)
            cols["tokens_per_s"].append(j.tokens_per_s)
            cols["data_wait_fraction"].append(j.data_wait_fraction if j.data_wait_fraction >= 0 else None)
            seen["node_id"].append(node_id)
            seen["job_id"].append(j.job_id)
            seen["ts"].append(j.ts_ns)
            seen["job_name"].append(j.job_name or None)
            seen["source"].append(None)
            seen["world_size"].append(None)
        types = {k: pa.float64() for k in names}
        types.update(ts=_ts_type(), node_id=pa.string(), job_id=pa.string(), job_name=pa.string(),
                     rank=pa.int32(), pid=pa.int32(), steps=pa.int32())
        job_steps = _table(cols, types)

    events = job_end = None
    if batch.events:
        cols = {k: [] for k in ("ts", "node_id", "gpu", "kind", "message", "value", "attrs")}
        ends = {"node_id": [], "job_id": [], "job_name": [], "ts": [], "duration_s": [], "avg_gpu_util_percent": [],
                "started_ns": [], "first_seen_ns": [], "last_seen_ns": []}
        for e in batch.events:
            if not e.kind:
                raise BatchError("INVALID_ARGUMENT", "event without a kind")
            _check_ts(f"event ts_ns ({e.kind})", e.ts_ns, e.ts_ns, max_ts)
            cols["ts"].append(e.ts_ns)
            cols["node_id"].append(node_id)
            cols["gpu"].append(_gpu_or_none(e.gpu))
            cols["kind"].append(e.kind)
            cols["message"].append(e.message)
            cols["value"].append(None if math.isnan(e.value) else e.value)
            cols["attrs"].append(_json(e.attrs))
            if e.kind == "job_end" and e.attrs.get("job_id"):
                try:
                    duration = float(e.attrs["duration_s"]) if "duration_s" in e.attrs else None
                except ValueError:
                    raise BatchError("INVALID_ARGUMENT",
                                     f"job_end event has a non-numeric duration_s {e.attrs['duration_s']!r}") from None
                ends["node_id"].append(node_id)
                ends["job_id"].append(e.attrs["job_id"])
                ends["job_name"].append(e.attrs.get("job_name") or None)
                ends["ts"].append(e.ts_ns)
                ends["duration_s"].append(duration)
                ends["avg_gpu_util_percent"].append(None if math.isnan(e.value) else e.value)
                for key in ("started_ns", "first_seen_ns", "last_seen_ns"):   # absent from older agents
                    ends[key].append(_job_end_time(e, key, max_ts))
        events = _table(cols, {"ts": _ts_type(), "node_id": pa.string(), "gpu": pa.int16(), "kind": pa.string(),
                               "message": pa.string(), "value": pa.float64(), "attrs": pa.string()})
        if ends["job_id"]:
            job_end = _table(ends, {"node_id": pa.string(), "job_id": pa.string(), "job_name": pa.string(),
                                    "ts": _ts_type(), "duration_s": pa.float64(),
                                    "avg_gpu_util_percent": pa.float64(), "started_ns": _ts_type(),
                                    "first_seen_ns": _ts_type(), "last_seen_ns": _ts_type()})

    job_seen = None
    if seen["job_id"]:
        job_seen = _table(seen, {"node_id": pa.string(), "job_id": pa.string(), "ts": _ts_type(),
                                 "job_name": pa.string(), "source": pa.string(), "world_size": pa.int32()})

    counts = (n_samples, len(batch.probe_results), len(batch.job_samples), len(batch.job_steps), len(batch.events))
    return PreparedBatch(node_id, batch.seq, n_samples, samples, probe_results, probe_metrics,
                         job_samples, job_steps, events, job_seen, job_end, counts)


# ---------------------------------------------------------------------------------------- writer

AckCallback = Callable[[pb.Ack | None, Exception | None], None]


@dataclass
class _BatchItem:
    prepared: PreparedBatch
    callback: AckCallback


@dataclass
class _CallItem:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future = field(default_factory=Future)


_STOP = object()


class SeqSet:
    """Exactly which seqs of one node are stored, as sorted disjoint runs ``[lo, hi]``.

    A cache of ``ingest_log``, never a guess: a seq is "stored" only when its row is there, so an ack with
    ``duplicate=true`` always names a batch the collector holds. Agents send their spool oldest first, so a
    node's seqs form one run (or a few, around a restart); membership and insertion are a bisect."""

    __slots__ = ("_lo", "_hi")

    def __init__(self, runs: list[tuple[int, int]] | None = None):
        runs = sorted(runs or [])
        self._lo = [a for a, _ in runs]
        self._hi = [b for _, b in runs]

    @property
    def highest(self) -> int:
        """The highest stored seq, 0 when none."""
        return self._hi[-1] if self._hi else 0

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._lo, self._hi))

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._lo, seq) - 1
        return i >= 0 and seq <= self._hi[i]

    def add(self, seq: int) -> None:
        i = bisect.bisect_right(self._lo, seq) - 1
        if i >= 0 and seq <= self._hi[i]:
            return
        joins_left = i >= 0 and self._hi[i] == seq - 1
        joins_right = i + 1 < len(self._lo) and self._lo[i + 1] == seq + 1
        if joins_left and joins_right:
            self._hi[i] = self._hi[i + 1]
            del self._lo[i + 1], self._hi[i + 1]
        elif joins_left:
            self._hi[i] = seq
        elif joins_right:
            self._lo[i + 1] = seq
        else:
            self._lo.insert(i + 1, seq)
            self._hi.insert(i + 1, seq)


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


_HOST_RE = re.compile(r"[^a-z0-9._-]+")

_SAMPLES_SQL = "INSERT INTO samples SELECT ts, node_id, gpu, metric, labels, value FROM _in_samples"
_PROBES_SQL = ("INSERT INTO probe_results SELECT node_id, probe, gpu, status, reason, params, params_key, env, "
               "started_at, ended_at, duration_s FROM _in_probe_results")
_PROBE_METRICS_SQL = ("INSERT INTO probe_metrics SELECT node_id, probe, gpu, params_key, started_at, metric, value "
                      "FROM _in_probe_metrics")
_JOB_SAMPLES_SQL = ("INSERT INTO job_samples SELECT ts, node_id, job_id, pid, rank, local_rank, gpu, "
                    "gpu_util_percent, gpu_memory_bytes, cpu_percent, rss_bytes, read_bytes_per_s, "
                    "write_bytes_per_s FROM _in_job_samples")
_JOB_STEPS_SQL = ("INSERT INTO job_steps SELECT ts, node_id, job_id, job_name, rank, pid, window_s, steps, "
                  "step_time_p50_s, step_time_p95_s, step_time_max_s, step_time_mean_s, steps_per_s, "
                  "samples_per_s, tokens_per_s, data_wait_fraction FROM _in_job_steps")
_EVENTS_SQL = "INSERT INTO events SELECT ts, node_id, gpu, kind, message, value, attrs FROM _in_events"
_JOBS_SEEN_SQL = """
INSERT INTO jobs (node_id, job_id, job_name, source, first_seen, last_seen, world_size)
SELECT node_id, job_id, max(job_name), max(source), min(ts), max(ts), max(world_size)
FROM _in_job_seen GROUP BY node_id, job_id
ON CONFLICT (node_id, job_id) DO UPDATE SET
    job_name = coalesce(excluded.job_name, jobs.job_name),
    source = coalesce(excluded.source, jobs.source),
    first_seen = least(jobs.first_seen, excluded.first_seen),
    last_seen = greatest(jobs.last_seen, excluded.last_seen),
    world_size = coalesce(excluded.world_size, jobs.world_size)
"""
_JOB_END_SQL = """
INSERT INTO jobs (node_id, job_id, job_name, first_seen, last_seen, started_at, ended_at, duration_s,
                  avg_gpu_util_percent)
SELECT node_id, job_id, job_name,
       -- an agent that sends no first_seen_ns (older ones): the event time less the duration, as before
       coalesce(first_seen_ns::TIMESTAMP,
                ts::TIMESTAMP - to_microseconds(CAST(coalesce(duration_s, 0) * 1e6 AS BIGINT))),
       coalesce(last_seen_ns, ts)::TIMESTAMP, started_ns::TIMESTAMP, coalesce(last_seen_ns, ts)::TIMESTAMP,
       coalesce(duration_s, 0), avg_gpu_util_percent
FROM _in_job_end
QUALIFY row_number() OVER (PARTITION BY node_id, job_id ORDER BY ts DESC) = 1
ON CONFLICT (node_id, job_id) DO UPDATE SET
    job_name = coalesce(jobs.job_name, excluded.job_name),
    last_seen = greatest(jobs.last_seen, excluded.last_seen),
    started_at = excluded.started_at,
    ended_at = excluded.ended_at,
    duration_s = CASE WHEN excluded.duration_s > 0 THEN excluded.duration_s
                      ELSE date_diff('microsecond', coalesce(excluded.started_at, jobs.first_seen),
                                     excluded.ended_at) / 1e6 END,
    avg_gpu_util_percent = excluded.avg_gpu_util_percent
"""

_INSERTS = (("samples", "_in_samples", _SAMPLES_SQL),
            ("probe_results", "_in_probe_results", _PROBES_SQL),
            ("probe_metrics", "_in_probe_metrics", _PROBE_METRICS_SQL),
            ("job_samples", "_in_job_samples", _JOB_SAMPLES_SQL),
            ("job_steps", "_in_job_steps", _JOB_STEPS_SQL),
            ("events", "_in_events", _EVENTS_SQL),
            ("job_seen", "_in_job_seen", _JOBS_SEEN_SQL),
            ("job_end", "_in_job_end", _JOB_END_SQL))


class Writer:
    """Owns the writing connection and the thread that uses it. Thread-safe ``submit``/``call``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, group_max_samples: int = 2_000_000,
                 group_max_batches: int = 2000, node_touch_interval_s: float = 5.0):
        self._con = con
        self._q: queue.Queue = queue.Queue()
        self._group_max_samples = group_max_samples
        self._group_max_batches = group_max_batches
        self._node_touch_interval_s = node_touch_interval_s
        self._seqs: dict[str, SeqSet] = {}
        self._touched: dict[str, float] = {}
        rows = con.execute("SELECT node_id, machine_id, hostname FROM nodes").fetchall()
        self.known_nodes: set[str] = {r[0] for r in rows}
        # node_id -> (machine_id, hostname), for the stream claims (identity.py); updated at Register.
        self.node_identity: dict[str, tuple[str, str]] = {r[0]: (r[1], r[2]) for r in rows}
        self.stats = {"groups": 0, "batches": 0, "duplicates": 0, "samples": 0, "failed_batches": 0,
                      "commit_s": 0.0}
        self.fatal: str | None = None     # set when the database cannot be written any more
        self._last_error_log = -1e9
        self._thread = threading.Thread(target=self._run, name="gpuagent-writer", daemon=True)
        self._stopped = False
        self._thread.start()

    # -- API for other threads
    def submit(self, prepared: PreparedBatch, callback: AckCallback) -> None:
        """Queue a batch; ``callback(ack, None)`` runs in the writer thread after commit (or
        ``callback(None, exc)`` when it could not be stored)."""
        self._q.put(_BatchItem(prepared, callback))

    def call(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Future:
        """Run ``fn(con)`` in the writer thread (for Register and other writes); returns a Future."""
        item = _CallItem(fn)
        self._q.put(item)
        return item.future

    def alive(self) -> bool:
        return self._thread.is_alive()

    def queue_depth(self) -> int:
        return self._q.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Store everything queued so far, then end the thread (the caller closes the connection)."""
        if not self._stopped:
            self._stopped = True
            self._q.put(_STOP)
        self._thread.join(timeout)

    # -- writer thread
    def _run(self) -> None:
        pending: list = []
        while True:
            item = pending.pop(0) if pending else self._q.get()
            if item is _STOP:
                return
            if isinstance(item, _CallItem):
                self._run_call(item)
                continue
            group = [item]
            n = item.prepared.n_samples
            while n < self._group_max_samples and len(group) < self._group_max_batches:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, _BatchItem):
                    pending.append(nxt)
                    break
                group.append(nxt)
                n += nxt.prepared.n_samples
            self._store_group(group)

    def _run_call(self, item: _CallItem) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            item.future.set_result(item.fn(self._con))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            item.future.set_exception(exc)

    def node_seqs(self, node_id: str) -> SeqSet:
        """Stored seqs of a node (loaded once from ingest_log, then kept current). Writer thread only."""
        st = self._seqs.get(node_id)
        if st is None:
            # Runs of consecutive seqs (gaps and islands): seq minus its rank is constant along a run.
            st = SeqSet([(int(a), int(b)) for a, b in self._con.execute(
                "SELECT min(seq), max(seq) FROM (SELECT seq, seq - row_number() OVER (ORDER BY seq) AS run "
                "FROM ingest_log WHERE node_id = ?) GROUP BY run", [node_id]).fetchall()])
            self._seqs[node_id] = st
        return st

    def _store_group(self, group: list[_BatchItem]) -> None:
        try:
            fresh, dup = [], []
            claimed: set[tuple[str, int]] = set()
            for it in group:
                p = it.prepared
                key = (p.node_id, p.seq)
                if key in claimed or p.seq in self.node_seqs(p.node_id):
                    dup.append(it)
                else:
                    claimed.add(key)
                    fresh.append(it)
            if fresh:
                started = time.perf_counter()
                self._commit(fresh)
                self.stats["commit_s"] += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if isinstance(exc, duckdb.FatalException) or "invalidated" in first:
                self.fatal = (f"the database can no longer be written ({first}); stopping so that a restart "
                              "can recover it from its write-ahead log")
            io_error = isinstance(exc, (duckdb.IOException, duckdb.TransactionException, duckdb.FatalException,
                                        OSError))
            if len(group) > 1 and not io_error:
                # A data problem validation did not catch: store one by one so that one batch fails alone.
                log.warning("group commit of %d batches failed (%s); retrying one by one", len(group), first)
                for it in group:
                    self._store_group([it])
                return
            self.stats["failed_batches"] += len(group)
            now = time.monotonic()
            if now - self._last_error_log >= 10.0:
                self._last_error_log = now
                log.error("could not store %d batch(es); they are refused and the agents keep them: %s",
                          len(group), first)
            for it in group:
                err = StorageError(f"the collector could not store batch seq {it.prepared.seq} of node "
                                   f"{it.prepared.node_id}: {first}")
                try:
                    it.callback(None, err)
                except Exception:  # noqa: BLE001
                    log.exception("ack callback failed")
            return
        for it in fresh:
            self.node_seqs(it.prepared.node_id).add(it.prepared.seq)
        self.stats["groups"] += 1
        self.stats["batches"] += len(fresh)
        self.stats["duplicates"] += len(dup)
        self.stats["samples"] += sum(it.prepared.n_samples for it in fresh)
        dup_ids = {id(it) for it in dup}
        for it in group:
            p = it.prepared
            ack = pb.Ack(seq=p.seq, duplicate=id(it) in dup_ids,
                         highest_committed_seq=self.node_seqs(p.node_id).highest)
            try:
                it.callback(ack, None)
            except Exception:  # noqa: BLE001
                log.exception("ack callback failed")

    def _commit(self, items: list[_BatchItem]) -> None:
        con = self._con
        now = utc_now()
        con.execute("BEGIN TRANSACTION")
        registered = []
        try:
            for attr, view, sql in _INSERTS:
                tables = [getattr(it.prepared, attr) for it in items]
                tables = [t for t in tables if t is not None]
                if not tables:
                    continue
                table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
                con.register(view, table)
                registered.append(view)
                con.execute(sql)
            log_rows = {
                "node_id": [it.prepared.node_id for it in items],
                "seq": [it.prepared.seq for it in items],
                "n_samples": [it.prepared.counts[0] for it in items],
                "n_probe_results": [it.prepared.counts[1] for it in items],
                "n_job_samples": [it.prepared.counts[2] for it in items],
                "n_job_steps": [it.prepared.counts[3] for it in items],
                "n_events": [it.prepared.counts[4] for it in items],
            }
            con.register("_in_ingest_log", pa.table(log_rows))
            registered.append("_in_ingest_log")
            con.execute("INSERT INTO ingest_log SELECT node_id, seq, ?, n_samples, n_probe_results, "
                        "n_job_samples, n_job_steps, n_events FROM _in_ingest_log", [now])
            mono = time.monotonic()
            stale = sorted({it.prepared.node_id for it in items
                            if mono - self._touched.get(it.prepared.node_id, -1e9) >= self._node_touch_interval_s})
            if stale:
                con.execute("UPDATE nodes SET last_seen = ? WHERE node_id IN (SELECT unnest(?))", [now, stale])
            con.execute("COMMIT")
            for node in stale:
                self._touched[node] = mono
        except BaseException:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            for view in registered:
                con.unregister(view)


# ---------------------------------------------------------------------------------------- register

def _node_id_for(con: duckdb.DuckDBPyConnection, hostname: str, machine_id: str) -> str:
    base = _HOST_RE.sub("-", hostname.lower()).strip("-.") or "node"
    candidates = [base, f"{base}-{_HOST_RE.sub('', machine_id.lower())[:8]}"]
    candidates += [f"{candidates[1]}-{i}" for i in range(2, 1000)]
    for cand in candidates:
        if not con.execute("SELECT 1 FROM nodes WHERE node_id = ?", [cand]).fetchone():
            return cand
    raise StorageError("could not find a free node id")  # pragma: no cover - 1000 collisions


def find_node(con: duckdb.DuckDBPyConnection, hostname: str, machine_id: str) -> str | None:
    """The node id of the host presenting ``machine_id`` and ``hostname``, or None for a new node.

    A node is the pair, not the machine id alone: VM images cloned without a fresh /etc/machine-id give
    several hosts one id, and keyed by it alone they shared one node and one seq space, so one host's
    batches were dropped as resends of the other's. Hostnames compare case-insensitively (as in DNS).
    A renamed host therefore starts a new node (its old rows stay under the old id). One exception keeps
    the fix we ask for cheap: a host whose node was marked as sharing its machine id with other hosts
    (``machine_id_shared_with``) and that comes back with a new machine id keeps its node."""
    row = con.execute("SELECT node_id FROM nodes WHERE machine_id = ? AND lower(hostname) = lower(?) "
                      "ORDER BY first_seen LIMIT 1", [machine_id, hostname]).fetchone()
    if row:
        return row[0]
    row = con.execute("SELECT node_id FROM nodes WHERE lower(hostname) = lower(?) AND machine_id <> ? "
                      "AND machine_id_shared_with IS NOT NULL ORDER BY last_seen DESC LIMIT 1",
                      [hostname, machine_id]).fetchone()
    return row[0] if row else None


def mark_shared_machine_id(con: duckdb.DuckDBPyConnection, node_id: str, hostnames: list[str]) -> None:
    """Record on ``node_id`` that ``hostnames`` streamed beside it with the same machine id."""
    row = con.execute("SELECT machine_id_shared_with FROM nodes WHERE node_id = ?", [node_id]).fetchone()
    if row is None:
        return
    have = set(filter(None, (row[0] or "").split(",")))
    want = ",".join(sorted(have | set(hostnames)))
    if want != (row[0] or ""):
        con.execute("UPDATE nodes SET machine_id_shared_with = ? WHERE node_id = ?", [want, node_id])


def register_node(con: duckdb.DuckDBPyConnection, node: pb.NodeInfo) -> str:
    """Upsert ``nodes`` and ``gpus`` for this host; return its stable node id (see ``find_node``).
    Writer thread only."""
    from google.protobuf import json_format

    now = utc_now()
    labels = dict(node.labels)
    price = labels.get("price_per_gpu_hour")
    try:
        price_f = float(price) if price not in (None, "") else None
    except ValueError:
        raise BatchError("INVALID_ARGUMENT",
                         f"label price_per_gpu_hour={price!r} is not a number") from None
    synthetic = labels.get("synthetic", "").lower() in ("1", "true", "yes")
    fp = node.fingerprint
    fingerprint_json = json.dumps(json_format.MessageToDict(fp, preserving_proto_field_name=True,
                                                            always_print_fields_with_no_presence=True),
                                  sort_keys=True)
    con.execute("BEGIN TRANSACTION")
    try:
        node_id = find_node(con, node.hostname, node.machine_id) or _node_id_for(con, node.hostname,
                                                                                 node.machine_id)
        keys = sorted(labels)
        con.execute(
            """INSERT INTO nodes (node_id, machine_id, hostname, agent_version, pool, provider, region,
                   price_per_gpu_hour, synthetic, labels, cpu_model, cpu_cores_logical, cpu_cores_physical,
                   memory_total_bytes, kernel, os, driver_version, cuda_version, gpu_count, gpu_model,
                   numa_nodes, virtualized, virt_type, in_container, container_runtime, clocksource,
                   fingerprint, first_seen, last_seen)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, map(?::VARCHAR[], ?::VARCHAR[]), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,
                       ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (node_id) DO UPDATE SET
                   machine_id_shared_with = CASE WHEN nodes.machine_id = excluded.machine_id
                                                 THEN nodes.machine_id_shared_with END,
                   machine_id = excluded.machine_id, hostname = excluded.hostname,
                   agent_version = excluded.agent_version, pool = excluded.pool, provider = excluded.provider,
                   region = excluded.region, price_per_gpu_hour = excluded.price_per_gpu_hour,
                   synthetic = excluded.synthetic, labels = excluded.labels, cpu_model = excluded.cpu_model,
                   cpu_cores_logical = excluded.cpu_cores_logical,
                   cpu_cores_physical = excluded.cpu_cores_physical,
                   memory_total_bytes = excluded.memory_total_bytes, kernel = excluded.kernel, os = excluded.os,
                   driver_version = excluded.driver_version, cuda_version = excluded.cuda_version,
                   gpu_count = excluded.gpu_count, gpu_model = excluded.gpu_model,
                   numa_nodes = excluded.numa_nodes, virtualized = excluded.virtualized,
                   virt_type = excluded.virt_type, in_container = excluded.in_container,
                   container_runtime = excluded.container_runtime, clocksource = excluded.clocksource,
                   fingerprint = excluded.fingerprint, last_seen = excluded.last_seen""",
            [node_id, node.machine_id, node.hostname, node.agent_version or None,
             labels.get("pool"), labels.get("provider"), labels.get("region"), price_f, synthetic,
             keys, [labels[k] for k in keys], node.cpu_model or None,
             node.cpu_cores_logical or None, node.cpu_cores_physical or None,
             node.memory_total_bytes or None, node.kernel or None, node.os or None,
             node.driver_version or None, node.cuda_version or None, len(node.gpus),
             node.gpus[0].name if node.gpus else None, node.numa_nodes or None,
             fp.virtualized, fp.virt_type or None, fp.in_container, fp.container_runtime or None,
             fp.clocksource or None, fingerprint_json, now, now])
        indexes = [g.index for g in node.gpus]
        if node.gpus:
            # One Arrow table for all GPUs, not bound parameters: DuckDB's Python binding does work
            # per bound value (it probes for pandas each time), which made Register cost ~60 ms.
            gpus_in = pa.table({
                "node_id": pa.array([node_id] * len(node.gpus), pa.string()),
                "gpu": pa.array(indexes, pa.int16()),
                "uuid": pa.array([g.uuid or None for g in node.gpus], pa.string()),
                "name": pa.array([g.name or None for g in node.gpus], pa.string()),
                "pci_bus_id": pa.array([g.pci_bus_id or None for g in node.gpus], pa.string()),
                "pcie_gen_max": pa.array([g.pcie_gen_max or None for g in node.gpus], pa.int16()),
                "pcie_gen_current": pa.array([g.pcie_gen_current or None for g in node.gpus], pa.int16()),
                "pcie_width_max": pa.array([g.pcie_width_max or None for g in node.gpus], pa.int16()),
                "pcie_width_current": pa.array([g.pcie_width_current or None for g in node.gpus], pa.int16()),
                "memory_total_bytes": pa.array([g.memory_total_bytes or None for g in node.gpus], pa.uint64()),
                "mig_mode": pa.array([g.mig_mode or None for g in node.gpus], pa.string()),
                "virtualization_mode": pa.array([g.virtualization_mode or None for g in node.gpus], pa.string()),
                "numa_node": pa.array([g.numa_node if g.numa_node >= 0 else None for g in node.gpus], pa.int16()),
            })
            con.register("_register_gpus_in", gpus_in)
            try:
                con.execute(
                    """INSERT INTO gpus SELECT * FROM _register_gpus_in
                       ON CONFLICT (node_id, gpu) DO UPDATE SET uuid = excluded.uuid, name = excluded.name,
                           pci_bus_id = excluded.pci_bus_id, pcie_gen_max = excluded.pcie_gen_max,
                           pcie_gen_current = excluded.pcie_gen_current, pcie_width_max = excluded.pcie_width_max,
                           pcie_width_current = excluded.pcie_width_current,
                           memory_total_bytes = excluded.memory_total_bytes, mig_mode = excluded.mig_mode,
                           virtualization_mode = excluded.virtualization_mode, numa_node = excluded.numa_node""")
            finally:
                con.unregister("_register_gpus_in")
        con.execute("DELETE FROM gpus WHERE node_id = ? AND NOT list_contains(?::SMALLINT[], gpu)",
                    [node_id, indexes])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return node_id
