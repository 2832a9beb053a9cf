"""Agent side of the opt-in tracker: receives step datagrams and aggregates them per job rank.

The socket (``$GPUAGENT_JOBS_SOCKET``, default ``/run/gpuagent/jobs.sock``) is a ``SOCK_DGRAM``
Unix socket. Its file is made mode 0666 (its folder 0755) so training processes of any local user
can send; a sender cannot pose as another process, because the agent takes the sender's pid from
the kernel (``SO_PASSCRED``) and derives the job identity from ``/proc/<pid>`` with the same rule as
job discovery (``job_identity``). It uses the identity the tracker announced only when ``/proc``
is unreadable or names no job (``pid:<pid>``) while the tracker does (its environment changed at
run time); :meth:`JobStepReceiver.tracked_pids` lets job discovery use the same id for that pid.

A small daemon thread blocks on the socket (the kernel queues only ~10 datagrams per socket by
default, ``net.unix.max_dgram_qlen``, so a once-per-tick drain would lose bursts); each sampling
tick (:meth:`JobStepReceiver.sample`) closes a window every ``window_s`` and emits one
``sink.job_step(...)`` per (job, rank) that stepped in it. Never imports torch.

MFU: when a tracker declared its model FLOPs (per step, or per token), each window also carries
``model_flops_per_s`` (steps/s x FLOPs per step, or tokens/s x FLOPs per token), and, when
``peak_flops(pid, local_rank)`` knows the rank's GPU peak, ``peak_flops_per_s`` and
``mfu = model_flops_per_s / peak_flops_per_s`` (a fraction).
"""

from __future__ import annotations

import errno
import math
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuagent.common.background import BackgroundThread
from gpuagent.common.job_identity import JobIdentity, identity_for_pid, own_container_id
from gpuagent.jobs import wire

_UCRED = struct.Struct("iII")          # struct ucred: pid, uid, gid
_MAX_RECORDS_PER_WINDOW = 100_000       # per tracker; beyond it a window keeps the first ones
_FORGET_AFTER_WINDOWS = 12
_PENDING_WINDOWS = 3                    # a tracker's windows wait this many for Slurm's name, then go out under its pid
_MAX_STREAMS = 4096                     # trackers kept at once: a local flood cannot grow memory without bound


class JobSocketError(RuntimeError):
    """The jobs socket cannot be set up (one clear sentence)."""


@dataclass
class _Stream:
    """One tracker (one process, usually one rank) and its records of the current window."""

    pid: int
    job_id: str
    job_name: str
    source: str
    rank: int
    local_rank: int
    world_size: int
    records: list = field(default_factory=list)   # (step_index, t_end_ns, step_ns, wait_ns, samples, tokens)
    last_index: int = 0                           # last step index of the previous window
    last_t_end_ns: int = 0
    last_seen_ns: int = 0
    overflow: int = 0
    closed: bool = False                          # the tracker said bye: report and forget it
    flops_per_step: float = 0.0                   # declared model FLOPs (0: not declared)
    flops_per_token: float = 0.0
    pending_windows: int = 0                      # windows it waited for the scheduler's name ("pending")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return math.nan
    k = max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1)
    return sorted_values[min(k, len(sorted_values) - 1)]


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2.0


def _combine(job_id: str, ranks: dict[int, dict[str, Any]], ts_ns: int) -> dict[str, Any]:
    """A job's live throughput from its ranks' newest windows: steps/s and the p50 are the highest over the
    ranks (ranks of a synchronous job step together); samples, tokens and model FLOPs per second add up;
    mfu is the FLOPs over the summed peaks of the ranks whose GPU peak is known."""
    job: dict[str, Any] = {"job_id": job_id, "job_name": "", "ranks": sorted(ranks), "steps_per_s": 0.0,
                           "samples_per_s": 0.0, "tokens_per_s": 0.0, "step_time_p50_s": 0.0,
                           "data_wait_fraction": -1.0, "model_flops_per_s": None, "mfu": None, "ts_ns": ts_ns}
    waits, done, peak = [], 0.0, 0.0
    for r in sorted(ranks):
        e = ranks[r]
        agg = e["agg"]
        job["job_name"] = job["job_name"] or e["job_name"]
        job["samples_per_s"] += agg["samples_per_s"]
        job["tokens_per_s"] += agg["tokens_per_s"]
        job["steps_per_s"] = max(job["steps_per_s"], agg["steps_per_s"])
        job["step_time_p50_s"] = max(job["step_time_p50_s"], agg["step_time_p50_s"])
        if agg["data_wait_fraction"] >= 0:
            waits.append(agg["data_wait_fraction"])
        if "model_flops_per_s" in agg:
            job["model_flops_per_s"] = (job["model_flops_per_s"] or 0.0) + agg["model_flops_per_s"]
            if "peak_flops_per_s" in agg:
                done += agg["model_flops_per_s"]
                peak += agg["peak_flops_per_s"]
    if peak > 0:
        job["mfu"] = done / peak
    job["data_wait_fraction"] = sum(waits) / len(waits) if waits else -1.0
    return job


def aggregate(records: list, prev_index: int, prev_t_end_ns: int) -> dict[str, float]:
    """Window statistics for one tracker's step records (the numbers that go into ``job_steps``).

    ``steps`` counts from the step indices, so datagrams lost on the way still count as steps;
    rates divide by the span from the previous window's last step end (or this window's first step
    start) to this window's last step end.
    """
    records = sorted(records)
    first, last = records[0], records[-1]
    if prev_index and prev_t_end_ns and last[0] > prev_index:
        steps = last[0] - prev_index
        span_ns = last[1] - prev_t_end_ns
    else:
        steps = last[0] - first[0] + 1
        span_ns = last[1] - (first[1] - first[2])
    span_s = max(span_ns / 1e9, 1e-9)
    times = sorted(r[2] / 1e9 for r in records)
    scale = steps / len(records)
    waited = [r for r in records if r[3] >= 0]
    wait_fraction = -1.0
    if waited:
        busy = sum(r[2] for r in waited)
        wait_fraction = min(1.0, sum(r[3] for r in waited) / busy) if busy > 0 else 0.0
    return {
        "window_s": span_s,
        "steps": int(steps),
        "step_time_p50_s": _median(times),
        "step_time_p95_s": _percentile(times, 95),
        "step_time_max_s": times[-1],
        "step_time_mean_s": sum(times) / len(times),
        "steps_per_s": steps / span_s,
        "samples_per_s": sum(r[4] for r in records) * scale / span_s,
        "tokens_per_s": sum(r[5] for r in records) * scale / span_s,
        "data_wait_fraction": wait_fraction,
    }


class JobStepReceiver:
    """Binds the jobs socket, receives tracker datagrams in a thread, emits per-window aggregates.

    Implements the ``Sampler`` protocol (``name``, ``sample(ts_ns, sink)``, ``close()``).
    """

    name = "job_steps"

    def __init__(self, socket_path: str | None = None, window_s: float = 5.0, *,
                 proc_root: str = "/proc", socket_mode: int = 0o666,
                 identity: Callable[[int], JobIdentity | None] | None = None,
                 clock: Callable[[], int] = time.time_ns,
                 peak_flops: Callable[[int, int], float | None] | None = None) -> None:
        self.socket_path = socket_path or wire.socket_path()
        self.window_ns = int(window_s * 1e9)
        self.socket_mode = socket_mode
        self._clock = clock
        self._proc_root = proc_root
        self._own_container = own_container_id(proc_root)
        self._identity = identity or self._identity_from_proc
        # Set by the daemon to JobDiscovery.slurm_job_of: (job id, name) of a pid as Slurm names it, for a
        # tracker whose environment names no job (its job_steps then join its job_samples).
        # A string (agent/schedulers/slurm.py's PENDING) while Slurm has not been asked about the pid yet: its windows wait.
        self.scheduler_job: Callable[[int], tuple[str, str] | str | None] | None = None
        self._peak_flops = peak_flops
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._live: dict[str, dict[str, Any]] = {}
        # (job_id, rank) -> that rank's newest closed window: {ts_ns, job_name, agg}. A job's live figure
        # combines its ranks' newest windows, so ranks whose windows close in different ticks (each
        # tracker's bye closes its own) still add up instead of the last one replacing the others.
        self._rank_live: dict[tuple[str, int], dict[str, Any]] = {}
        self._window_start = clock()
        self._sock: socket.socket | None = None
        self._worker = BackgroundThread("gpuagent-job-steps", self._run)
        self._stop = self._worker.stopping
        self.datagrams = 0
        self.bad_datagrams = 0
        self.records = 0            # step records kept for aggregation
        self.overflowed = 0         # step records received past the per-window cap (not aggregated)
        self.refused_streams = 0    # datagrams of new trackers refused while _MAX_STREAMS were kept

    # ------------------------------------------------------------------ socket

    def start(self) -> "JobStepReceiver":
        """Create the folder and socket and start the receiving thread. Raises JobSocketError."""
        path = self.socket_path
        folder = os.path.dirname(path) or "."
        try:
            if not os.path.isdir(folder):
                os.makedirs(folder, mode=0o755, exist_ok=True)
        except OSError as e:
            raise JobSocketError(f"cannot create the jobs socket folder {folder}: {e.strerror}") from None
        self._remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            os.chmod(path, self.socket_mode)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.settimeout(1.0)    # how soon stop() is noticed; datagrams wake it at once
        except OSError as e:
            sock.close()
            raise JobSocketError(f"cannot listen on the jobs socket {path}: {e.strerror}") from None
        self._sock = sock
        self._worker.start()
        return self

    @staticmethod
    def _remove_stale(path: str) -> None:
        """Unlink a socket file nobody listens on; refuse to touch a live one or a non-socket."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise JobSocketError(f"cannot inspect {path}: {e.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise JobSocketError(f"{path} exists and is not a socket; remove it or set GPUAGENT_JOBS_SOCKET")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(path)
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                return
            raise JobSocketError(f"cannot inspect {path}: {e.strerror}") from None
        finally:
            probe.close()
        raise JobSocketError(f"another process already listens on {path} (is a second agent running?)")

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        ancbuf = socket.CMSG_SPACE(_UCRED.size)
        while not self._stop.is_set():
            try:
                data, anc, _flags, _addr = sock.recvmsg(wire.MAX_STEPS_BYTES + 4096, ancbuf)
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            kernel_pid = 0
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
                    kernel_pid = _UCRED.unpack_from(payload)[0]
            self.receive(data, kernel_pid)

    def receive(self, data: bytes, kernel_pid: int = 0) -> None:
        """Take one datagram (``kernel_pid``: the sender as the kernel saw it; 0 if unknown)."""
        self.datagrams += 1
        try:
            kind, msg = wire.decode(data)
        except wire.WireError:
            self.bad_datagrams += 1
            return
        pid = kernel_pid or msg["pid"]
        key = (pid, msg["tracker_id"])
        now = self._clock()
        with self._lock:
            stream = self._streams.get(key)
            if stream is None and kind != "bye" and len(self._streams) >= _MAX_STREAMS:
                self.refused_streams += 1
                return
            if kind == "hello":
                self._streams[key] = self._new_stream(pid, msg, stream)
                return
            if kind == "bye":
                if stream is not None:
                    stream.closed = True
                return
            if stream is None:
                stream = self._new_stream(pid, {"rank": msg["rank"], "local_rank": -1, "world_size": 0,
                                                "job_id": f"pid:{pid}", "job_name": "", "source": "process"},
                                          None)
                self._streams[key] = stream
            stream.last_seen_ns = now
            room = _MAX_RECORDS_PER_WINDOW - len(stream.records)
            recs = msg["records"]
            if len(recs) > room:
                stream.overflow += len(recs) - max(room, 0)
                self.overflowed += len(recs) - max(room, 0)
                recs = recs[:max(room, 0)]
            stream.records.extend(recs)
            self.records += len(recs)

    def _new_stream(self, pid: int, hello: dict[str, Any], old: _Stream | None) -> _Stream:
        ident = self._identity(pid)
        if ident is not None and ident.source == "process" and hello["source"] not in ("", "process"):
            # /proc shows the environment the process started with; the tracker saw its own
            # (possibly set at run time) and named a job: trust it for its own process.
            ident = None
        if ident is not None:
            job_id, source = ident.job_id, ident.source
            local_rank = ident.local_rank
            world_size = ident.world_size
        else:
            job_id, source = hello["job_id"] or f"pid:{pid}", hello["source"] or "process"
            local_rank, world_size = hello["local_rank"], hello["world_size"]
        rank = hello["rank"] if hello["rank"] >= 0 else (ident.rank if ident else -1)
        name = hello["job_name"] or (ident.job_name if ident else "")
        if source == "process" and job_id == f"pid:{pid}":
            job_id, name, source = self._scheduler_named(pid, job_id, name, source)
        stream = _Stream(pid=pid, job_id=job_id, job_name=name, source=source, rank=rank,
                         local_rank=local_rank, world_size=world_size, last_seen_ns=self._clock(),
                         flops_per_step=hello.get("flops_per_step", 0.0),
                         flops_per_token=hello.get("flops_per_token", 0.0))
        if old is not None:
            stream.records, stream.last_index, stream.last_t_end_ns = (old.records, old.last_index,
                                                                      old.last_t_end_ns)
        return stream

    def _identity_from_proc(self, pid: int) -> JobIdentity | None:
        return identity_for_pid(pid, self._proc_root, self._own_container)

    def _scheduler_named(self, pid: int, job_id: str, name: str, source: str) -> tuple[str, str, str]:
        """A tracker named only by its pid takes its scheduler's name for the process where there is one;
        source "pending" while the scheduler has not been asked about it yet."""
        hit = self.scheduler_job(pid) if self.scheduler_job is not None else None
        if hit is None:
            return job_id, name, "process" if source == "pending" else source
        if isinstance(hit, str):
            return job_id, name, "pending"
        return hit[0], hit[1] or name, "slurm"     # Slurm's name first, as job discovery names it

    # ------------------------------------------------------------------ windows

    def sample(self, ts_ns: int, sink: Any) -> None:
        """Once per tick: when the window is over, emit one job_step per (job, rank) that stepped;
        a tracker that said bye gets its last partial window emitted at once."""
        if ts_ns - self._window_start < self.window_ns:
            self.flush_window(ts_ns, sink, closed_only=True)
            return
        self.flush_window(ts_ns, sink)

    def flush_window(self, ts_ns: int, sink: Any, closed_only: bool = False) -> int:
        """Close the current window now (``closed_only``: only for trackers that said bye);
        returns how many job_step rows were emitted."""
        if not closed_only:
            self._window_start = ts_ns
        with self._lock:
            ready = []
            for key, s in list(self._streams.items()):
                if closed_only and not s.closed:
                    continue
                if s.source in ("process", "pending") and s.job_id == f"pid:{s.pid}":
                    # Slurm's details may have come since the hello
                    s.job_id, s.job_name, s.source = self._scheduler_named(s.pid, s.job_id, s.job_name, s.source)
                    if s.source == "pending":
                        s.pending_windows += 1
                        if s.pending_windows <= _PENDING_WINDOWS and not s.closed:
                            continue     # its records wait for the id (a window under the pid would not join)
                        s.source = "process"   # waited long enough (slurmctld down?): the pid's own job, as before
                if s.records:
                    ready.append((s, s.records, s.last_index, s.last_t_end_ns))
                    last = max(s.records)
                    s.last_index, s.last_t_end_ns = last[0], last[1]
                    s.records = []
                if s.closed or (not s.records and ts_ns - s.last_seen_ns > _FORGET_AFTER_WINDOWS * self.window_ns):
                    del self._streams[key]
        closed: list[tuple[_Stream, dict[str, Any]]] = []
        for s, records, prev_index, prev_t_end in ready:
            agg = aggregate(records, prev_index, prev_t_end)
            agg.update(self._mfu(s, agg))
            sink.job_step(ts_ns=ts_ns, job_id=s.job_id, job_name=s.job_name, rank=s.rank, pid=s.pid, **agg)
            closed.append((s, agg))
        with self._lock:
            for s, agg in closed:
                self._rank_live[(s.job_id, s.rank)] = {"ts_ns": ts_ns, "job_name": s.job_name, "agg": agg}
            touched = {s.job_id for s, _ in closed}
            for job_id in touched:
                ranks = {r: e for (j, r), e in self._rank_live.items() if j == job_id}
                newest = max(e["ts_ns"] for e in ranks.values())
                for r, e in list(ranks.items()):
                    if newest - e["ts_ns"] > self.window_ns:     # a rank that stopped a window ago or more
                        del self._rank_live[(job_id, r)], ranks[r]
                self._live[job_id] = _combine(job_id, ranks, newest)
            # Keep a job's last figures visible for a few windows after it stops stepping.
            for job_id, old in list(self._live.items()):
                if job_id not in touched and ts_ns - old["ts_ns"] > 3 * self.window_ns:
                    del self._live[job_id]
                    for key in [k for k in self._rank_live if k[0] == job_id]:
                        del self._rank_live[key]
        return len(ready)

    def _mfu(self, s: _Stream, agg: dict[str, float]) -> dict[str, float]:
        """model_flops_per_s (and peak_flops_per_s, mfu when the GPU's peak is known) for a declared job."""
        if s.flops_per_step > 0:
            done = agg["steps_per_s"] * s.flops_per_step
        elif s.flops_per_token > 0 and agg["tokens_per_s"] > 0:
            done = agg["tokens_per_s"] * s.flops_per_token
        else:
            return {}
        out = {"model_flops_per_s": done}
        peak = self._peak_flops(s.pid, s.local_rank) if self._peak_flops is not None else None
        if peak:
            out["peak_flops_per_s"] = peak
            out["mfu"] = done / peak
        return out

    def live(self) -> list[dict[str, Any]]:
        """Each tracked job's throughput in the last closed window (for ``gpuagent status``).

        ``steps_per_s`` and ``step_time_p50_s`` are the highest over the job's ranks on this node
        (ranks of a synchronous job step together); samples/tokens per second and model FLOPs/s add up
        over ranks; ``mfu`` is their FLOPs over their GPUs' summed peaks (None: not declared/no peak).
        """
        with self._lock:
            return [dict(v, ranks=list(v["ranks"])) for v in sorted(self._live.values(), key=lambda j: j["job_id"])]

    def stream_count(self) -> int:
        """Trackers (one per process and tracker id) the receiver currently keeps."""
        with self._lock:
            return len(self._streams)

    def tracked_pids(self) -> dict[int, str]:
        """pid -> job_id of every process that currently sends steps (job discovery can use it)."""
        with self._lock:
            return {s.pid: s.job_id for s in self._streams.values()}

    def close(self) -> None:
        self._worker.stop(2.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
