"""The batcher: a thread-safe ``SampleSink`` that turns samples into columnar ``Batch`` messages.

Samples accumulate as three parallel columns plus a per-batch series dictionary (ids are local to the
batch, so any batch stands on its own even when the spool dropped the ones before it). A batch is cut
every ``batch_interval_s`` or when it reaches ``batch_max_samples``; each cut gets the next per-node
sequence number from :class:`SeqAllocator`, which persists it before it is used so a number is never
reused, even after SIGKILL.

With a summary interval (``[agent] summary_interval_s``, docs/RESOLUTION.md) only the series some rule reads
sample by sample (common/resolution.py) go into the columns, the hardware counters and states only when they
change (and once per interval); every other series becomes per-interval summaries, and its samples wait in a
bounded ring for the collector's raw-window requests.

The batcher also keeps the latest value of every series, the last result of every probe and the latest
job samples/steps: ``gpuagent status`` shows them without a second path to the data sources.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpuagent.agent.pipeline.resolution import RawRing, Summaries
from gpuagent.agent.samplers.sampling import now_ns, sorted_labels
from gpuagent.common.atomic_file import atomic_write
from gpuagent.common.resolution import ON_CHANGE, SUMMARY, resolution_of
from gpuagent.proto import pb

_JOB_SAMPLE_FIELDS = {f.name for f in pb.JobSample.DESCRIPTOR.fields}
_JOB_STEP_FIELDS = {f.name for f in pb.JobStep.DESCRIPTOR.fields}
_REMEMBERED_REQUESTS = 1000      # raw-window request ids answered, so a resent request is not answered twice


class SeqAllocator:
    """Per-node batch sequence numbers: start at 1, strictly increasing, never reused.

    The file ``seq`` in the state dir holds the highest number handed out. It is written (fsync +
    rename) *before* the number is returned, so a crash can only skip numbers, never repeat one.
    """

    def __init__(self, state_dir: str | os.PathLike, floor: int = 0):
        self.path = Path(state_dir) / "seq"
        self._lock = threading.Lock()
        self.fresh = not self.path.exists()      # no number was ever handed out from this state dir
        self._last = max(self._read(), floor)

    def _read(self) -> int:
        try:
            return int(self.path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except (ValueError, OSError):
            # Unreadable: the spool floor and the collector's last_committed_seq still move us past
            # anything already used (see raise_floor).
            return 0

    @property
    def last(self) -> int:
        return self._last

    def next(self) -> int:
        with self._lock:
            seq = self._last + 1
            atomic_write(self.path, f"{seq}\n".encode(), fsync=True)
            self._last = seq
            return seq

    def raise_floor(self, seq: int) -> None:
        """Never hand out ``seq`` or below (e.g. the collector already holds it)."""
        with self._lock:
            if seq > self._last:
                atomic_write(self.path, f"{seq}\n".encode(), fsync=True)
                self._last = seq


def _ns(v: Any) -> int:
    """Timestamps from probe results: ns ints pass through, float/int seconds are scaled."""
    if v is None or v == "":
        return 0
    x = float(v)
    return int(x) if abs(x) > 1e14 else int(x * 1e9)


def probe_result_message(result: Mapping[str, Any]) -> pb.ProbeResult:
    """A probe's JSON result (see sampling.SampleSink.probe_result) as a ProbeResult message."""
    msg = pb.ProbeResult(
        probe=str(result.get("probe", "")),
        status=str(result.get("status", "")),
        reason=str(result.get("reason", "") or ""),
        started_ns=_ns(result.get("started_ns", result.get("started_at"))),
        ended_ns=_ns(result.get("ended_ns", result.get("ended_at"))),
        gpu=int(result.get("gpu", -1) if result.get("gpu") is not None else -1),
    )
    for k, v in (result.get("params") or {}).items():
        msg.params[str(k)] = v if isinstance(v, str) else json.dumps(v)
    for k, v in (result.get("env") or {}).items():
        msg.env[str(k)] = v if isinstance(v, str) else json.dumps(v)
    for k, v in (result.get("metrics") or {}).items():
        try:
            msg.metrics[str(k)] = float(v)
        except (TypeError, ValueError):
            continue  # a non-numeric metric is not a metric; the probe's params/env carry text
    return msg


class Batcher:
    """Implements SampleSink. Thread-safe: samplers, the probe scheduler and the job listener share it."""

    def __init__(self, seq: SeqAllocator, batch_interval_s: float = 5.0, max_samples: int = 50_000,
                 clock=time.monotonic, summary_interval_s: float = 0.0, raw_keep_s: float = 900.0):
        self._seq = seq
        self.batch_interval_s = batch_interval_s
        self.max_samples = max_samples
        self._clock = clock
        self._lock = threading.Lock()
        # Resolution: None = every series raw (summary_interval_s 0).
        self.summaries = Summaries(summary_interval_s) if summary_interval_s > 0 else None
        self.ring = RawRing(raw_keep_s) if summary_interval_s > 0 else None
        self._resolution_of: dict[tuple, str] = {}
        self._heartbeat_ns = int(summary_interval_s * 1e9)
        self._last_sent: dict[tuple, tuple[int, float]] = {}   # ON_CHANGE series: the last sample sent
        self._answers: deque[dict[str, Any]] = deque()
        self._answered: OrderedDict[str, None] = OrderedDict()
        self._reset()
        self._last_cut = clock()
        # For `gpuagent status`.
        self.latest: dict[tuple[str, int, tuple[tuple[str, str], ...]], tuple[int, float]] = {}
        self.last_probe: dict[str, dict[str, Any]] = {}
        self.latest_jobs: dict[tuple[str, int], dict[str, Any]] = {}
        self.latest_steps: dict[tuple[str, int], dict[str, Any]] = {}
        self.recent_events: list[dict[str, Any]] = []
        self.total_samples = 0
        self.total_batches = 0

    def _reset(self) -> None:
        self._series: dict[tuple[str, int, tuple[tuple[str, str], ...]], int] = {}
        self._ts: list[int] = []
        self._sid: list[int] = []
        self._val: list[float] = []
        self._probes: list[pb.ProbeResult] = []
        self._job_samples: list[pb.JobSample] = []
        self._job_steps: list[pb.JobStep] = []
        self._events: list[pb.Event] = []

    # ---------------------------------------------------------------- SampleSink
    def add(self, metric: str, value: float, gpu: int = -1, labels: Mapping[str, str] | None = None,
            ts_ns: int | None = None) -> None:
        key = (metric, int(gpu), sorted_labels(labels))
        ts = ts_ns if ts_ns is not None else now_ns()
        v = float(value)
        how = self._resolution_of.get(key)
        if how is None:
            how = self._resolution_of[key] = "" if self.summaries is None else resolution_of(metric)
        with self._lock:
            if how == SUMMARY:
                self.summaries.add(key, ts, v)
                self.ring.add(key, ts, v)
                self.latest[key] = (ts, v)
                return
            if how == ON_CHANGE:
                last = self._last_sent.get(key)
                if last is not None and last[1] == v and ts - last[0] < self._heartbeat_ns:
                    self.latest[key] = (ts, v)      # unchanged: the last sample sent still says it
                    return
                self._last_sent[key] = (ts, v)
            sid = self._series.get(key)
            if sid is None:
                sid = self._series[key] = len(self._series)
            self._ts.append(ts)
            self._sid.append(sid)
            self._val.append(v)
            self.latest[key] = (ts, v)

    def event(self, kind: str, message: str, gpu: int = -1, value: float = 0.0,
              attrs: Mapping[str, str] | None = None, ts_ns: int | None = None) -> None:
        ts = ts_ns if ts_ns is not None else now_ns()
        ev = pb.Event(ts_ns=ts, kind=kind, gpu=int(gpu), message=message, value=float(value),
                      attrs={str(k): str(v) for k, v in (attrs or {}).items()})
        with self._lock:
            self._events.append(ev)
            self.recent_events.append({"ts_ns": ts, "kind": kind, "gpu": int(gpu), "message": message,
                                       "value": float(value), "attrs": dict(ev.attrs)})
            del self.recent_events[:-20]

    def job_sample(self, **f: Any) -> None:
        f = {k: v for k, v in f.items() if k in _JOB_SAMPLE_FIELDS and v is not None}
        f.setdefault("ts_ns", now_ns())
        if "attrs" in f:
            f["attrs"] = {str(k): str(v) for k, v in f["attrs"].items()}
        msg = pb.JobSample(**f)
        with self._lock:
            self._job_samples.append(msg)
            self.latest_jobs[(msg.job_id, msg.pid)] = dict(f)

    def job_step(self, **f: Any) -> None:
        f = {k: v for k, v in f.items() if k in _JOB_STEP_FIELDS and v is not None}
        f.setdefault("ts_ns", now_ns())
        msg = pb.JobStep(**f)
        with self._lock:
            self._job_steps.append(msg)
            self.latest_steps[(msg.job_id, msg.rank)] = dict(f)

    def probe_result(self, result: Mapping[str, Any]) -> None:
        msg = probe_result_message(result)
        with self._lock:
            self._probes.append(msg)
            key = msg.probe if msg.gpu < 0 else f"{msg.probe}[gpu{msg.gpu}]"
            self.last_probe[key] = {"probe": msg.probe, "gpu": msg.gpu, "status": msg.status,
                                    "reason": msg.reason, "metrics": dict(msg.metrics),
                                    "ended_ns": msg.ended_ns}

    # ---------------------------------------------------------------- for the status snapshot
    def latest_values(self) -> dict[tuple[str, int, tuple[tuple[str, str], ...]], tuple[int, float]]:
        """(metric, gpu, labels) -> (ts_ns, value) of every series' latest sample."""
        with self._lock:
            return dict(self.latest)

    def recent_jobs(self, since_ns: int, forget_before_ns: int) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """The latest sample of each job process seen since ``since_ns`` with its rank's latest step (or
        None), by (job_id, pid); processes last seen before ``forget_before_ns`` are dropped for good."""
        with self._lock:
            for key in [k for k, v in self.latest_jobs.items() if v.get("ts_ns", 0) < forget_before_ns]:
                del self.latest_jobs[key]
            return [(dict(j), self.latest_steps.get((job_id, j.get("rank", -1))))
                    for (job_id, _pid), j in sorted(self.latest_jobs.items()) if j.get("ts_ns", 0) >= since_ns]

    def last_probes(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self.last_probe)

    def last_events(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.recent_events[-n:])

    # ---------------------------------------------------------------- cutting
    @property
    def pending_samples(self) -> int:
        return len(self._ts)

    def _pending(self) -> bool:
        return bool(self._ts or self._probes or self._job_samples or self._job_steps or self._events
                    or self._answers or (self.summaries is not None and self.summaries.pending))

    def discard_pending(self) -> int:
        """Drop everything pending (the caller counts it); returns the number of samples dropped."""
        with self._lock:
            n = len(self._ts)
            if self.summaries is not None:
                n += sum(c[2] for c in self.summaries.take())
            self._reset()
            return n

    # ---------------------------------------------------------------- resolution
    def close_open_summaries(self) -> None:
        """Close the partial intervals too, so the next cut carries them (the agent is stopping)."""
        with self._lock:
            if self.summaries is not None:
                self.summaries.close_all()

    def request_raw(self, requests: Iterable[Any]) -> int:
        """Queue answers to the collector's raw-window requests (pb.RawWindowRequest); each id is answered
        once. Returns how many were new. The samples are taken now, so the ring moving on loses none."""
        fresh = []
        with self._lock:
            for r in requests:
                if r.request_id in self._answered:
                    continue
                self._answered[r.request_id] = None
                while len(self._answered) > _REMEMBERED_REQUESTS:
                    self._answered.popitem(last=False)
                fresh.append(r)
            if not fresh:
                return 0
            blocks = self.ring.snapshot() if self.ring is not None else []
            held = self.ring.held_since_ns if self.ring is not None else 0
        # The samples are picked out of the blocks without the lock, so the samplers never wait on it.
        answers = [{"id": r.request_id, "since": r.since_ns, "until": r.until_ns, "at": 0, "held": held,
                    "rows": list(RawRing.window_of(blocks, r.since_ns, r.until_ns))} for r in fresh]
        with self._lock:
            self._answers.extend(answers)
        return len(answers)

    def _take_answers(self, budget: int) -> list[pb.RawWindow]:
        """RawWindow parts of at most ``budget`` samples in all (at least one part per cut while any wait)."""
        out: list[pb.RawWindow] = []
        while self._answers and (budget > 0 or not out):
            a = self._answers[0]
            part = a["rows"][a["at"]:a["at"] + max(budget, 1)]
            a["at"] += len(part)
            budget -= len(part)
            msg = pb.RawWindow(request_id=a["id"], since_ns=a["since"], until_ns=a["until"],
                               held_since_ns=a["held"], final=a["at"] >= len(a["rows"]))
            ids: dict[tuple, int] = {}
            keys = self.ring.keys if self.ring is not None else {}    # every sample raw: an empty, final answer
            msg.samples.series_id.extend(_series_id(ids, keys[s], msg.samples.series) for _, s, _ in part)
            msg.samples.ts_ns.extend(t for t, _, _ in part)
            msg.samples.value.extend(v for _, _, v in part)
            out.append(msg)
            if msg.final:
                self._answers.popleft()
        return out

    def start_clock(self, now: float) -> None:
        self._last_cut = now

    def due(self, now: float | None = None) -> bool:
        """Time to cut: the batch interval passed, or the size cap is reached.

        The daemon passes each tick's *scheduled* monotonic time, so a 5 s batch at 1 s sampling is
        cut every 5th tick exactly, whatever the wake-up jitter."""
        now = self._clock() if now is None else now
        return (now - self._last_cut >= self.batch_interval_s - 1e-6) or len(self._ts) >= self.max_samples

    def cut(self, now: float | None = None) -> pb.Batch | None:
        """Take everything pending as one Batch with a fresh seq; None when nothing is pending."""
        with self._lock:
            self._last_cut = self._clock() if now is None else now
            if self.summaries is not None:
                wall = now_ns()
                self.summaries.close_ended(wall)
                self.ring.seal(wall)
            if not self._pending():
                return None
        # The seq is persisted first: if that fails (e.g. disk full) the OSError reaches the caller and
        # the samples stay pending for the next cut instead of being lost.
        seq = self._seq.next()
        with self._lock:
            series, ts, sid, val = self._series, self._ts, self._sid, self._val
            probes, jsamples, jsteps, events = self._probes, self._job_samples, self._job_steps, self._events
            summaries = self.summaries.take() if self.summaries is not None else []
            answers = self._take_answers(self.max_samples - len(ts)) if self._answers else []
            self._reset()
        batch = pb.Batch(seq=seq, created_ns=now_ns())
        cols = batch.samples
        for (metric, gpu, labels), i in series.items():
            cols.series.add(id=i, metric=metric, gpu=gpu, labels=dict(labels))
        cols.ts_ns.extend(ts)
        cols.series_id.extend(sid)
        cols.value.extend(val)
        if summaries:
            _summary_columns(batch.summaries, self.summaries.interval_ns, summaries)
        batch.raw_windows.extend(answers)
        batch.probe_results.extend(probes)
        batch.job_samples.extend(jsamples)
        batch.job_steps.extend(jsteps)
        batch.events.extend(events)
        self.total_samples += len(ts)
        self.total_batches += 1
        return batch


def _series_id(ids: dict[tuple, int], key: tuple, series) -> int:
    """``key``'s id in a message's own series dictionary (``series``), added on first use."""
    i = ids.get(key)
    if i is None:
        i = ids[key] = len(ids)
        metric, gpu, labels = key
        series.add(id=i, metric=metric, gpu=gpu, labels=dict(labels))
    return i


def _summary_columns(sc: pb.SummaryColumns, interval_ns: int, rows: list) -> None:
    """Fill ``sc`` from closed summaries (key, start_ns, n, sum, min, max), with a per-batch dictionary."""
    sc.interval_ns = interval_ns
    ids: dict[tuple, int] = {}
    sc.series_id.extend(_series_id(ids, r[0], sc.series) for r in rows)
    for field_name, col in (("start_ns", 1), ("count", 2), ("sum", 3), ("min", 4), ("max", 5)):
        getattr(sc, field_name).extend(r[col] for r in rows)
