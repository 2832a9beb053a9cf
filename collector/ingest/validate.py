"""Checking a Batch completely and turning it into the Arrow tables the writer stores.

Runs in the gRPC handlers, not the writer thread, so that validation and conversion overlap with commits.
A batch is refused as a whole (``BatchError``, one sentence) or stored as a whole. Column names and types
come from the declarations in collector/store/tables.py.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from gpuagent.collector.store import tables as t
from gpuagent.collector.store.writer import PreparedBatch
from gpuagent.proto import pb

# Timestamps before 2000-01-01 are certainly a unit mistake (seconds or ms sent as ns).
MIN_TS_NS = 946_684_800 * 1_000_000_000
MAX_SEQ = 2**63 - 1     # seqs are stored as UBIGINT but exported to Parquet/Spark, which have no unsigned type
PROBE_STATUSES = frozenset({"ok", "skipped", "failed", "timeout"})
JOB_END_TIMES = ("started_ns", "first_seen_ns", "last_seen_ns")    # optional attrs of a job_end event


class BatchError(Exception):
    """A batch that must be refused as a whole. ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    max_samples_per_batch: int = 1_000_000
    max_rows_per_batch: int = 100_000       # probe results + job samples + job steps + events
    max_series_per_batch: int = 100_000     # entries of the batch's series dictionary
    max_future_s: float = 86_400.0          # a timestamp may run ahead of the collector clock by this


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


def _index_or_none(i: int) -> int | None:
    """GPU, rank and local rank: -1 on the wire means none (a host-level row, a rank not known)."""
    return None if i < 0 else i


GPU_MAX = 32767      # the gpu columns are SMALLINT


def _gpu_or_none(g: int) -> int | None:
    """A GPU index that fits the store, or one sentence (a larger one overflowed into an INTERNAL error)."""
    if g > GPU_MAX:
        raise BatchError("INVALID_ARGUMENT", f"gpu index {g} is out of range (at most {GPU_MAX})")
    return _index_or_none(g)


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def _check_ts(name: str, lo: int, hi: int, max_ts: int) -> None:
    if lo < MIN_TS_NS or hi > max_ts:
        bad = lo if lo < MIN_TS_NS else hi
        raise BatchError("INVALID_ARGUMENT",
                         f"{name} {bad} is not a plausible Unix time in nanoseconds "
                         f"(must lie between 2000-01-01 and the collector's clock plus the allowed skew)")


def _job_end_time(e, key: str, max_ts: int) -> int | None:
    """One of a job_end event's wall-clock ns attrs (``JOB_END_TIMES``), or None when it was not sent."""
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


@dataclass(frozen=True)
class _SeriesPart:
    """What a batch's series dictionary gives every batch that sends the same one: ids in sorted order, and
    the metric, gpu and labels of each series (Arrow dictionaries and a numpy gpu column)."""

    sorted_ids: np.ndarray
    order: np.ndarray
    gpu: np.ndarray
    metric: pa.Array
    labels: pa.Array


def _series_part(series) -> _SeriesPart:
    ids = np.fromiter((s.id for s in series), dtype=np.int64, count=len(series))
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    if len(sorted_ids) > 1 and bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
        raise BatchError("INVALID_ARGUMENT", "the series dictionary defines the same series id twice")
    metrics = [s.metric for s in series]
    gpus = [s.gpu for s in series]
    if not all(metrics):
        raise BatchError("INVALID_ARGUMENT", f"series {series[metrics.index('')].id} has an empty metric name")
    if min(gpus) < -1:
        bad = next(s for s in series if s.gpu < -1)
        raise BatchError("INVALID_ARGUMENT", f"series {bad.id} has gpu index {bad.gpu} (use -1 for host-level)")
    if max(gpus) > GPU_MAX:
        bad = next(s for s in series if s.gpu > GPU_MAX)
        raise BatchError("INVALID_ARGUMENT",
                         f"series {bad.id} has gpu index {bad.gpu}, out of range (at most {GPU_MAX})")
    labels = [labels_text(s.labels) for s in series]
    return _SeriesPart(sorted_ids, order, np.asarray(gpus, dtype=t.SAMPLES.type("gpu").to_pandas_dtype()),
                       pa.array(metrics, t.SAMPLES.type("metric")), pa.array(labels, t.SAMPLES.type("labels")))


class SeriesCache:
    """The last series dictionary one stream sent, with its ``_SeriesPart``.

    An agent's batches repeat the same dictionary while its series stay the same (agent/pipeline/batcher.py
    numbers them in the order each tick samples them). Comparing two dictionaries is a C-speed protobuf
    compare, about a fifth of deriving the part in Python (0.18 against 0.8 ms for 500 series, 2026-12-07),
    so a stream pays the derivation only when its dictionary changes. Only a valid dictionary is kept."""

    def __init__(self) -> None:
        self._series = pb.SampleColumns()
        self._part: _SeriesPart | None = None
        self.hits = 0
        self.misses = 0

    def part(self, series) -> _SeriesPart:
        if self._part is not None and series == self._series.series:
            self.hits += 1
            return self._part
        self.misses += 1
        part = _series_part(series)          # raises on an invalid dictionary, keeping the last valid one
        self._series.Clear()
        self._series.series.extend(series)
        self._part = part
        return part


def _positions(part: _SeriesPart, sid: np.ndarray, noun: str) -> np.ndarray:
    """Each row's position in the series dictionary; an id the dictionary lacks is the batch's error."""
    sorted_ids = part.sorted_ids
    where = np.searchsorted(sorted_ids, sid)
    where_clipped = np.minimum(where, len(sorted_ids) - 1)
    unknown = sorted_ids[where_clipped] != sid
    if bool(unknown.any()):
        bad = int(sid[np.argmax(unknown)])
        raise BatchError("INVALID_ARGUMENT", f"{noun} refers to series id {bad}, which the batch does not define")
    return part.order[where_clipped].astype(np.int32)


def _summaries_table(node_id: str, sc: pb.SummaryColumns, max_ts: int) -> pa.Table | None:
    """Per-interval summaries (docs/RESOLUTION.md) as samples_summary rows."""
    n = len(sc.start_ns)
    lengths = {"series_id": len(sc.series_id), "count": len(sc.count), "sum": len(sc.sum), "min": len(sc.min),
               "max": len(sc.max)}
    if any(v != n for v in lengths.values()):
        raise BatchError("INVALID_ARGUMENT", "summary arrays differ in length: start_ns="
                         + str(n) + ", " + ", ".join(f"{k}={v}" for k, v in lengths.items()))
    if n == 0:
        return None
    interval_ns = sc.interval_ns
    if interval_ns <= 0 or interval_ns % 1_000_000_000 or 60_000_000_000 % interval_ns:
        raise BatchError("INVALID_ARGUMENT", f"summaries have interval_ns {interval_ns}: it must be a whole number of "
                                             "seconds that divides a minute")
    if not sc.series:
        raise BatchError("INVALID_ARGUMENT", f"{n} summaries but the batch defines no summary series")
    part = _series_part(sc.series)
    start = np.asarray(sc.start_ns, dtype=np.int64)
    _check_ts("summary start_ns", int(start.min()), int(start.max()), max_ts)
    if bool((start % interval_ns).any()):
        raise BatchError("INVALID_ARGUMENT", "a summary's start_ns is not a multiple of its interval_ns")
    count = np.asarray(sc.count, dtype=np.int64)
    if bool((count < 1).any()) or int(count.max()) > 2**31 - 1:
        raise BatchError("INVALID_ARGUMENT", "a summary has a count below 1 or above 2^31-1")
    lo = np.asarray(sc.min, dtype=np.float64)
    hi = np.asarray(sc.max, dtype=np.float64)
    if bool((lo > hi).any()):
        raise BatchError("INVALID_ARGUMENT", "a summary has min above max")
    pos = _positions(part, np.asarray(sc.series_id, dtype=np.int64), "summary")
    gpu = part.gpu[pos]
    gpu_mask = gpu < 0
    pos_array = pa.array(pos)
    decl = t.SAMPLES_SUMMARY
    return pa.table({
        "ts": pa.Array.from_buffers(decl.type("ts"), n, [None, pa.py_buffer(start)]),
        "node_id": pa.array([node_id] * n, decl.type("node_id")),
        "gpu": pa.array(gpu, decl.type("gpu"), mask=gpu_mask if gpu_mask.any() else None),
        "metric": pa.DictionaryArray.from_arrays(pos_array, part.metric),
        "labels": pa.DictionaryArray.from_arrays(pos_array, part.labels),
        "interval_s": pa.array(np.full(n, interval_ns / 1e9), decl.type("interval_s")),
        "n": pa.array(count.astype(np.int32), decl.type("n")),
        "sum": pa.array(np.asarray(sc.sum, dtype=np.float64), decl.type("sum")),
        "min": pa.array(lo, decl.type("min")),
        "max": pa.array(hi, decl.type("max")),
    })


def _raw_window_tables(node_id: str, windows, max_ts: int, now_ns: int) -> tuple[pa.Table | None, pa.Table | None]:
    """The samples of raw-window answer parts (raw_windows rows) and what each part says of its request."""
    if not windows:
        return None, None
    parts, answered = [], []
    for w in windows:
        if not w.request_id:
            raise BatchError("INVALID_ARGUMENT", "raw window without a request_id")
        table = _samples_table(node_id, w.samples, max_ts)
        rows = 0 if table is None else table.num_rows
        if table is not None:
            parts.append(table.add_column(0, "request_id", pa.array([w.request_id] * rows, t.RAW_WINDOWS.type("request_id"))))
        answered.append((w.request_id, node_id, rows, w.final, w.held_since_ns or None, now_ns))
    samples = None
    if parts:
        samples = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive")
    return samples, t.RAW_ANSWERED.from_rows(answered)


def _samples_table(node_id: str, cols: pb.SampleColumns, max_ts: int,
                   cache: SeriesCache | None = None) -> pa.Table | None:
    """The samples in columnar form, converted with numpy (a batch can hold a million of them)."""
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
    part = cache.part(series) if cache is not None else _series_part(series)

    # The protobuf containers expose __array__, so these are C-speed copies, not Python loops.
    ts = np.asarray(cols.ts_ns, dtype=np.int64)
    sid = np.asarray(cols.series_id, dtype=np.int64)
    values = np.asarray(cols.value, dtype=np.float64)
    _check_ts("sample ts_ns", int(ts.min()), int(ts.max()), max_ts)

    pos = _positions(part, sid, "sample")

    gpu = part.gpu[pos]
    gpu_mask = gpu < 0
    nan_mask = np.isnan(values)
    # Dictionary-encoded where a column repeats per series: the values keep the declared type.
    pos_array = pa.array(pos)
    return pa.table({
        "ts": pa.Array.from_buffers(t.SAMPLES.type("ts"), n, [None, pa.py_buffer(ts)]),
        "node_id": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)),
                                                  pa.array([node_id], t.SAMPLES.type("node_id"))),
        "gpu": pa.array(gpu, t.SAMPLES.type("gpu"), mask=gpu_mask if gpu_mask.any() else None),
        "metric": pa.DictionaryArray.from_arrays(pos_array, part.metric),
        "labels": pa.DictionaryArray.from_arrays(pos_array, part.labels),
        "value": pa.array(values, t.SAMPLES.type("value"), mask=nan_mask if nan_mask.any() else None),
    })


class _Derived:
    """Rows that a batch's messages imply for other tables (probe metrics, the jobs upserts)."""

    def __init__(self) -> None:
        self.probe_metrics: list[tuple] = []
        self.job_seen: list[tuple] = []
        self.job_end: list[tuple] = []


@dataclass(frozen=True)
class _Rows:
    """How one repeated field of a Batch becomes rows of ``table``.

    Every message must have ``key`` set (else "<noun> without <key_words>"); with ``check_ts`` its ts_ns must
    be plausible. ``row`` checks the rest and returns the message's row in the table's column order."""

    field: str
    table: t.Table
    noun: str
    key: str
    key_words: str
    check_ts: bool
    row: Callable[..., tuple]      # (message, node_id, created_ns, max_ts, derived) -> row


def _probe_row(r, node_id: str, created_ns: int, max_ts: int, derived: _Derived) -> tuple:
    if r.status not in PROBE_STATUSES:
        raise BatchError("INVALID_ARGUMENT",
                         f"probe {r.probe!r} has status {r.status!r}; expected one of "
                         f"{', '.join(sorted(PROBE_STATUSES))}")
    # A result without times (e.g. a probe that failed before it started) takes the other time,
    # else the batch's creation time, rather than costing the whole batch.
    started = r.started_ns or r.ended_ns or created_ns
    ended = r.ended_ns or started
    _check_ts(f"probe {r.probe!r} started_ns", started, started, max_ts)
    if ended < started:
        raise BatchError("INVALID_ARGUMENT", f"probe {r.probe!r} ended before it started")
    _check_ts(f"probe {r.probe!r} ended_ns", ended, ended, max_ts)
    key = labels_text(r.params)
    gpu = _gpu_or_none(r.gpu)
    for metric in sorted(r.metrics):
        value = r.metrics[metric]
        derived.probe_metrics.append((node_id, r.probe, gpu, key, started, metric,
                                      value if value == value else None))   # NaN: not measured
    return (node_id, r.probe, gpu, r.status, r.reason or None, _json(r.params), key, _json(r.env),
            started, ended, (ended - started) / 1e9)


def _job_sample_row(j, node_id: str, created_ns: int, max_ts: int, derived: _Derived) -> tuple:
    derived.job_seen.append((node_id, j.job_id, j.ts_ns, j.job_name or None, j.source or None,
                             j.world_size if j.world_size > 0 else None, j.attrs.get("slurm_user") or None,
                             j.attrs.get("slurm_partition") or None, j.attrs.get("slurm_account") or None,
                             j.attrs.get("pod") or None, j.attrs.get("namespace") or None,
                             j.attrs.get("container") or None))
    return (j.ts_ns, node_id, j.job_id, j.pid, _index_or_none(j.rank), _index_or_none(j.local_rank),
            _gpu_or_none(j.gpu), j.gpu_util_percent, j.gpu_memory_bytes, j.cpu_percent, j.rss_bytes,
            j.read_bytes_per_s, j.write_bytes_per_s)


def _job_step_row(j, node_id: str, created_ns: int, max_ts: int, derived: _Derived) -> tuple:
    derived.job_seen.append((node_id, j.job_id, j.ts_ns, j.job_name or None, *(None,) * 8))
    return (j.ts_ns, node_id, j.job_id, j.job_name or None, _index_or_none(j.rank), j.pid, j.window_s, j.steps,
            j.step_time_p50_s, j.step_time_p95_s, j.step_time_max_s, j.step_time_mean_s, j.steps_per_s,
            j.samples_per_s, j.tokens_per_s, j.data_wait_fraction if j.data_wait_fraction >= 0 else None,
            _positive_or_none(j.model_flops_per_s), _positive_or_none(j.peak_flops_per_s), _positive_or_none(j.mfu))


def _positive_or_none(v: float) -> float | None:
    """MFU fields: 0 (not declared, peak unknown) and non-finite values are NULL."""
    return v if v > 0 and math.isfinite(v) else None


def _event_row(e, node_id: str, created_ns: int, max_ts: int, derived: _Derived) -> tuple:
    if e.kind == "job_end" and e.attrs.get("job_id"):
        try:
            duration = float(e.attrs["duration_s"]) if "duration_s" in e.attrs else None
        except ValueError:
            raise BatchError("INVALID_ARGUMENT",
                             f"job_end event has a non-numeric duration_s {e.attrs['duration_s']!r}") from None
        derived.job_end.append((node_id, e.attrs["job_id"], e.attrs.get("job_name") or None, e.ts_ns, duration,
                                _nan_to_none(e.value), *(_job_end_time(e, k, max_ts) for k in JOB_END_TIMES)))
    return (e.ts_ns, node_id, _gpu_or_none(e.gpu), e.kind, e.message, _nan_to_none(e.value), _json(e.attrs))


_ROW_KINDS = (
    _Rows("probe_results", t.PROBE_RESULTS, "probe result", "probe", "a probe name", False, _probe_row),
    _Rows("job_samples", t.JOB_SAMPLES, "job sample", "job_id", "a job_id", True, _job_sample_row),
    _Rows("job_steps", t.JOB_STEPS, "job step", "job_id", "a job_id", True, _job_step_row),
    _Rows("events", t.EVENTS, "event", "kind", "a kind", True, _event_row),
)


def _rows_table(kind: _Rows, messages, node_id: str, created_ns: int, max_ts: int,
                derived: _Derived) -> pa.Table | None:
    if not messages:
        return None
    rows = []
    for m in messages:
        key = getattr(m, kind.key)
        if not key:
            raise BatchError("INVALID_ARGUMENT", f"{kind.noun} without {kind.key_words}")
        if kind.check_ts:
            _check_ts(f"{kind.noun} ts_ns ({key})", m.ts_ns, m.ts_ns, max_ts)
        rows.append(kind.row(m, node_id, created_ns, max_ts, derived))
    return kind.table.from_rows(rows)


def _check_size(batch: pb.Batch, limits: Limits) -> None:
    n_samples = len(batch.samples.ts_ns) + len(batch.summaries.start_ns) + sum(len(w.samples.ts_ns)
                                                                              for w in batch.raw_windows)
    if n_samples > limits.max_samples_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch has {n_samples} samples, over the collector's limit of "
                         f"{limits.max_samples_per_batch} per batch; send smaller batches")
    n_series = len(batch.samples.series)
    if n_series > limits.max_series_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch defines {n_series} series, over the collector's limit of "
                         f"{limits.max_series_per_batch} per batch; send smaller batches")
    n_rows = sum(len(getattr(batch, kind.field)) for kind in _ROW_KINDS)
    if n_rows > limits.max_rows_per_batch:
        raise BatchError("RESOURCE_EXHAUSTED",
                         f"batch has {n_rows} probe/job/event rows, over the collector's limit of "
                         f"{limits.max_rows_per_batch} per batch; send smaller batches")


def prepare_batch(batch: pb.Batch, limits: Limits = Limits(), now_ns: int | None = None,
                  series_cache: SeriesCache | None = None) -> PreparedBatch:
    """Validate ``batch`` completely and build its Arrow tables; raise BatchError on anything wrong.
    ``series_cache``: the stream's (one per stream, not shared between threads)."""
    if not batch.node_id:
        raise BatchError("INVALID_ARGUMENT", "batch has no node_id (call Register first)")
    if not 1 <= batch.seq <= MAX_SEQ:
        raise BatchError("INVALID_ARGUMENT", f"batch seq {batch.seq} is out of range: seq must be 1 or more and at "
                                             f"most 2^63-1 ({MAX_SEQ}), the signed 64-bit range every reader of "
                                             "the store has")
    _check_size(batch, limits)
    now_ns = time.time_ns() if now_ns is None else now_ns
    max_ts = now_ns + int(limits.max_future_s * 1e9)
    node_id = batch.node_id

    samples = _samples_table(node_id, batch.samples, max_ts, series_cache)
    derived = _Derived()
    rows = {kind.field: _rows_table(kind, getattr(batch, kind.field), node_id, batch.created_ns, max_ts, derived)
            for kind in _ROW_KINDS}

    def optional(table: t.Table, found: list[tuple]) -> pa.Table | None:
        return table.from_rows(found) if found else None

    summaries = _summaries_table(node_id, batch.summaries, max_ts)
    raw_windows, raw_answered = _raw_window_tables(node_id, batch.raw_windows, max_ts, now_ns)
    n_samples = len(batch.samples.ts_ns)
    counts = (n_samples, len(batch.probe_results), len(batch.job_samples), len(batch.job_steps), len(batch.events))
    return PreparedBatch(node_id, batch.seq, n_samples, samples, rows["probe_results"],
                         optional(t.PROBE_METRICS, derived.probe_metrics), rows["job_samples"], rows["job_steps"],
                         rows["events"], optional(t.JOB_SEEN, derived.job_seen), optional(t.JOB_END, derived.job_end),
                         counts, summaries, raw_windows, raw_answered)
