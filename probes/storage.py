"""storage: sequential read/write throughput and random-read IOPS/latency on a given path.

How it measures (the fio equivalent in brackets, which benchmarks/probe_accuracy.py runs side by side):
  * seq_write_gbps: writes a fresh file of ``size_mib`` in 1 MiB O_DIRECT blocks of random bytes, then
    fdatasync; the time includes the fdatasync [fio rw=write bs=1M direct=1 ioengine=psync end_fsync=1].
    One pass only, on purpose: a probe that runs every hour on every node must not wear out its SSD, so
    it writes ``size_mib`` per run and no more; being short, this figure follows the device's drift
    (7-15 % run to run on a shared virtio disk, where fio itself varies as much);
  * seq_read_gbps: reads it back in 1 MiB O_DIRECT blocks, one at a time, looping over the file for
    ``seq_seconds``, timed per 32 MiB segment; the headline is the median segment rate, with the 10th
    percentile (seq_read_p10_gbps: the dips) and the plain bytes/window rate (seq_read_mean_gbps: what
    fio reports) beside it [rw=read bs=1M direct=1 psync time_based]. Why time-based and a median: on a
    virtio disk the rate dips by 20-30 % for 0.5-1 s at a time (the host's other tenants), so one 0.2 s
    pass over 256 MiB landed in or out of a dip and 5 back-to-back runs varied by 10-19 %;
  * rand_read_iops, p50/p99 latency: ``queue_depth`` forked worker processes, each with its own O_DIRECT
    descriptor issuing blocking os.preadv of 4 KiB at random aligned offsets for ``rand_seconds``, so QD
    requests are in flight together with no GIL between them [rw=randread bs=4k direct=1
    ioengine=psync numjobs=QD time_based]. Latency is per request, measured around preadv (the Python
    call adds ~1 µs); under heavy CPU contention a worker waiting for a CPU shows up in the tail.
Safety: it checks free space first and refuses (skipped, with the numbers) if writing the file would
leave less than ``min_free_percent`` of the filesystem free; the file has a unique name, is removed in a
finally block (SIGTERM from the runner unwinds into it), and files left by a killed run (SIGKILL) are
removed by the next run once their pid is gone. With ``file=...`` it only reads that existing file
(read-only, nothing written or removed; seq_write_gbps is then absent).
Where O_DIRECT is refused (some FUSE/overlay filesystems, tmpfs before Linux 6.6) it falls back to
buffered I/O, reports o_direct=0 and says that the page cache may be in play; on memory filesystems
(tmpfs, ramfs) O_DIRECT may be accepted but bypasses nothing, so they too report o_direct=0.
"""

from __future__ import annotations

import array
import errno
import mmap
import os
import random
import re
import signal
import statistics
import struct
import time
import uuid
from typing import Any

from gpuagent.probes import blockdev, progress
from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

SPEC = ProbeSpec(
    name="storage",
    description="O_DIRECT 1 MiB sequential read/write GB/s, 4 KiB random-read IOPS and p50/p99 latency",
    platform="any",
    defaults={"path": "/var/tmp", "size_mib": 256, "queue_depth": 4, "rand_seconds": 3.0, "seq_seconds": 5.0,
              "file": "", "min_free_percent": 5.0, "seed": 1},
    resources=frozenset({"disk"}),
    timeout_s=180.0,
    interval_s=3600.0,
    param_help={"path": "directory on the filesystem to test", "file": "existing file to read (read-only mode)",
                "queue_depth": "concurrent 4 KiB reads in flight (processes)",
                "seq_seconds": "how long the sequential read loops over the file"},
    limits={"size_mib": (1, None), "queue_depth": (1, 256), "rand_seconds": (0.05, 600),
            "seq_seconds": (0.05, 600), "min_free_percent": (0, 100)},
)

MEMORY_FS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
SEQ_BLOCK = 1 << 20
SEQ_SEGMENT = 32 << 20  # sequential reads are timed per segment of this size (or the file, if smaller)
RAND_BLOCK = 4096
PREFIX = ".gpuagent-probe-storage."
_NAME_RE = re.compile(r"^\.gpuagent-probe-storage\.(\d+)\.[0-9a-f]+\.tmp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(directory: str) -> int:
    """Remove probe files whose writer process is gone (a run killed with SIGKILL). Returns how many."""
    removed = 0
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    for name in entries:
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page aligned


def _open(path: str, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)


def _seq_write(fd: int, size: int) -> float:
    buf = _aligned(SEQ_BLOCK)
    buf.write(os.urandom(SEQ_BLOCK))  # incompressible, so thin/deduplicating disks cannot cheat
    try:
        t0 = time.perf_counter_ns()
        for off in range(0, size, SEQ_BLOCK):
            if os.pwritev(fd, [buf], off) != SEQ_BLOCK:
                raise OSError(errno.EIO, "short write")
        os.fdatasync(fd)
        return (time.perf_counter_ns() - t0) / 1e9
    finally:
        buf.close()


def _segment(size: int) -> int:
    """Segment size: the file split into equal whole-MiB parts of at most SEQ_SEGMENT."""
    parts = -(-size // SEQ_SEGMENT)
    return max(SEQ_BLOCK, size // parts // SEQ_BLOCK * SEQ_BLOCK)


def _seq_read(fd: int, size: int, seconds: float) -> tuple[list[float], int, float]:
    """Read the file front to back in 1 MiB blocks, wrapping around, until ``seconds`` have passed (at
    least one whole pass). Returns (per-segment rates in GB/s, bytes read, elapsed s)."""
    buf = _aligned(SEQ_BLOCK)
    bufs, preadv, clock = [buf], os.preadv, time.perf_counter_ns
    seg = _segment(size)
    rates: list[float] = []
    done = 0
    try:
        t_start = clock()
        deadline = t_start + int(seconds * 1e9)
        off = 0
        while True:
            t0 = clock()
            for o in range(off, off + seg, SEQ_BLOCK):
                if preadv(fd, bufs, o) <= 0:
                    raise OSError(errno.EIO, "unexpected end of file")
            t1 = clock()
            rates.append(seg / (t1 - t0))  # bytes per ns == GB/s
            done += seg
            off += seg
            if off + seg > size:
                off = 0
            if t1 >= deadline and done >= size:
                return rates, done, (t1 - t_start) / 1e9
    finally:
        buf.close()


def _rand_child(path: str, direct: bool, nblocks: int, seed: int, start_r: int, out_w: int) -> None:
    """One worker: its own descriptor, one blocking 4 KiB read in flight at a time, until the deadline."""
    fd = _open(path, os.O_RDONLY, direct)
    buf = _aligned(RAND_BLOCK)
    bufs = [buf]
    pick = random.Random(seed).randrange
    lats = array.array("q")
    add = lats.append
    preadv, clock = os.preadv, time.monotonic_ns
    deadline = struct.unpack("q", os.read(start_r, 8))[0]
    first = t1 = clock()
    while t1 < deadline:
        off = pick(nblocks) * RAND_BLOCK
        t0 = clock()
        preadv(fd, bufs, off)
        t1 = clock()
        add(t1 - t0)
    with os.fdopen(out_w, "wb") as f:
        f.write(struct.pack("qqq", first, t1, len(lats)) + lats.tobytes())


def _rand_read(path: str, direct: bool, size: int, qd: int, seconds: float, seed: int
               ) -> tuple[int, float, list[int]]:
    """(completed reads, elapsed s, per-read latencies in ns) of ``qd`` worker processes for ``seconds``.

    Processes, not threads: no GIL hand-offs between workers, the model of fio's psync numjobs=QD."""
    nblocks = size // RAND_BLOCK
    children: list[tuple[int, int, int]] = []
    try:
        for i in range(qd):
            start_r, start_w = os.pipe()
            out_r, out_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # worker
                code = 1
                try:
                    os.close(start_w)
                    os.close(out_r)
                    _rand_child(path, direct, nblocks, seed * 1000 + i, start_r, out_w)
                    code = 0
                except BaseException:  # noqa: BLE001 - the parent reports a failed worker
                    import traceback
                    traceback.print_exc()
                finally:
                    os._exit(code)
            os.close(start_r)
            os.close(out_w)
            children.append((pid, start_w, out_r))
        deadline = time.monotonic_ns() + 20_000_000 + int(seconds * 1e9)  # all start together
        for _, start_w, _ in children:
            os.write(start_w, struct.pack("q", deadline))
        firsts, lasts, lats = [], [], array.array("q")
        for pid, start_w, out_r in children:
            with os.fdopen(out_r, "rb") as f:
                data = f.read()
            os.close(start_w)
            _, status = os.waitpid(pid, 0)
            children = [c for c in children if c[0] != pid]
            if status != 0 or len(data) < 24:
                raise OSError(errno.EIO, f"a random-read worker failed (wait status {status})")
            first, last, n = struct.unpack("qqq", data[:24])
            firsts.append(first)
            lasts.append(last)
            part = array.array("q")
            part.frombytes(data[24:24 + 8 * n])
            lats.extend(part)
    finally:
        for pid, start_w, out_r in children:  # only on error: leave no worker behind
            for fd in (start_w, out_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    elapsed = (max(lasts) - min(firsts)) / 1e9
    return len(lats), elapsed, list(lats)


def _pct(sorted_vals: list[int], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    idx = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return float(sorted_vals[idx])


def run(params: dict[str, Any]) -> ProbeResult:
    started = time.time_ns()
    p = dict(params)
    qd = int(p["queue_depth"])             # ranges are checked by registry.parse_params (SPEC.limits)
    size = int(p["size_mib"]) * SEQ_BLOCK
    read_only = bool(p["file"])
    target_dir = os.path.dirname(os.path.abspath(p["file"])) if read_only else p["path"]
    env: dict[str, Any] = {"backend": "cpu", "path": os.path.abspath(p["file"] or p["path"]),
                           "device": blockdev.device_for_path(target_dir),
                           "fs_type": blockdev.fs_type_for_path(target_dir),
                           "concurrency": f"{qd} processes x blocking preadv (fio: ioengine=psync numjobs={qd})"}
    if not os.path.isdir(target_dir):
        return ProbeResult.skipped("storage", f"directory {target_dir} does not exist", p, env)

    notes: list[str] = []
    path = ""
    created = False
    direct = True
    fd = -1
    try:
        if read_only:
            path = os.path.abspath(p["file"])
            if not os.path.isfile(path):
                return ProbeResult.skipped("storage", f"file {path} does not exist", p, env)
            size = min(size, os.path.getsize(path) // SEQ_BLOCK * SEQ_BLOCK)
            if size < SEQ_BLOCK:
                return ProbeResult.skipped("storage", f"file {path} is smaller than 1 MiB", p, env)
            env["read_only"] = 1
        else:
            env["stale_files_removed"] = cleanup_stale(target_dir)
            vfs = os.statvfs(target_dir)
            avail = vfs.f_bavail * vfs.f_frsize
            total = vfs.f_blocks * vfs.f_frsize
            reserve = int(total * float(p["min_free_percent"]) / 100.0)
            if avail - size < reserve:
                return ProbeResult.skipped(
                    "storage",
                    f"not enough free space on {target_dir}: the probe writes {size >> 20} MiB and must "
                    f"leave {reserve >> 20} MiB ({p['min_free_percent']:g} %) free, but only "
                    f"{avail >> 20} MiB are available", p, env)
            path = os.path.join(target_dir, f"{PREFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
            try:
                fd = _open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False
                fd = _open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, False)
            created = True
            progress.step(0, 3, f"sequential write, {size >> 20} MiB")
            write_s = _seq_write(fd, size)
            os.close(fd)
            fd = -1
        if direct:
            try:
                fd = _open(path, os.O_RDONLY, True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False
        if direct and env["fs_type"] in MEMORY_FS:
            direct = False  # accepted since Linux 6.6, but the data lives in RAM: it bypasses nothing
            os.close(fd)
            fd = -1
        if not direct:
            fd = _open(path, os.O_RDONLY, False)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drops clean pages where it can
            notes.append(f"O_DIRECT is not available or not effective on {env['fs_type'] or 'this filesystem'}; "
                         "buffered I/O was used, so the page cache may be in play")
        progress.step(1, 3, f"sequential read, {float(p['seq_seconds']):g} s")
        seq_rates, read_bytes, read_s = _seq_read(fd, size, float(p["seq_seconds"]))
        progress.step(2, 3, f"random 4 KiB reads at QD {qd}, {float(p['rand_seconds']):g} s")
        n, elapsed, lats = _rand_read(path, direct, size, qd, float(p["rand_seconds"]), int(p["seed"]))
    finally:
        if fd >= 0:
            os.close(fd)
        if created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    lats.sort()
    seq_rates.sort()
    metrics = {"seq_read_gbps": statistics.median(seq_rates),
               "seq_read_p10_gbps": _pct(seq_rates, 0.10),
               "seq_read_mean_gbps": read_bytes / read_s / 1e9,
               "rand_read_iops": n / elapsed,
               "rand_read_p50_latency_us": _pct(lats, 0.50) / 1000.0,
               "rand_read_p99_latency_us": _pct(lats, 0.99) / 1000.0,
               "o_direct": 1.0 if direct else 0.0}
    if not read_only:
        metrics["seq_write_gbps"] = size / write_s / 1e9
    env["rand_reads"] = n
    env["seq_read_segments"] = len(seq_rates)
    env["seq_read_segment_mib"] = _segment(size) >> 20
    return ProbeResult("storage", "ok", "; ".join(notes), p, metrics, started, time.time_ns(), env)
