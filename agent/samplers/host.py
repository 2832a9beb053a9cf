"""Host sampler: CPU, load, memory, disks, NICs, TCP retransmits, context switches, interrupts and PSI from /proc.

It reads the /proc files directly (a handful of small reads per tick) rather than going through
psutil's per-call machinery, because the daemon must stay under 1 % of one core at 1 s sampling. The
proc and sys roots are injectable (the prometheus client_python ``process_collector`` pattern) so
tests parse recorded fixtures under tests/data/proc_*. Rates need two ticks: the first tick emits
only gauges. Loop devices, RAM disks (ram*, zram*) and partitions are skipped; so is ``lo``.
Metric names: docs/METRICS.md ("Host sampler").
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("gpuagent.host_sampler")

_SKIP_DISK = re.compile(r"^(loop|ram|zram|fd|sr)\d*")
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def decode(b: bytes) -> str:
    """/proc and sysfs text as str. Names are whatever bytes the kernel holds: valid UTF-8 stays as it is,
    other bytes become ``\\xNN`` text, so two names that differ in bytes stay two labels (an "ascii, replace"
    decode merged them) and every label stays valid UTF-8 for protobuf."""
    return b.decode("utf-8", "backslashreplace")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return decode(f.read())
    except OSError:
        return None


class SourceGuard:
    """Each source fails alone: a malformed line is skipped and counted, a source that raises is caught and
    counted, and either is logged at most once per ``log_every_s`` per source (with the count since)."""

    def __init__(self, owner: str, log_every_s: float = 600.0) -> None:
        self.owner = owner
        self.bad_lines: dict[str, int] = {}      # source -> malformed lines skipped since start
        self.errors: dict[str, int] = {}         # source -> ticks on which the source raised
        self.log_every_s = log_every_s
        self._logged: dict[str, tuple[float, int]] = {}

    def bad_line(self, source: str, where: str, line: str, exc: BaseException | None = None) -> None:
        n = self.bad_lines[source] = self.bad_lines.get(source, 0) + 1
        why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        self._log(source, n, f"{self.owner} sampler skipped a malformed line in {where}: {line[:120]!r}{why}")

    def run(self, source: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - one broken source must not stop the others
            n = self.errors[source] = self.errors.get(source, 0) + 1
            self._log("!" + source, n, f"{self.owner} sampler source {source} failed: {type(exc).__name__}: {exc}")

    def _log(self, key: str, n: int, message: str) -> None:
        now = time.monotonic()
        last = self._logged.get(key)
        if last is not None and now - last[0] < self.log_every_s:
            return
        held = n - (last[1] if last else 0) - 1
        self._logged[key] = (now, n)
        log.warning("%s%s", message, f" ({held} more since the last report)" if held > 0 else
                    f" (reported at most once per {self.log_every_s:g} s)")

    def notes(self) -> list[str]:
        """One status line per source that skipped lines or raised."""
        out = [f"{self.owner} sampler: {n} malformed line(s) skipped in source {src}"
               for src, n in sorted(self.bad_lines.items())]
        out += [f"{self.owner} sampler: source {src} raised on {n} tick(s)" for src, n in sorted(self.errors.items())]
        return out


class _ProcFiles:
    """Keeps /proc files open and re-reads them with pread at offset 0 (as procps does for /proc/stat):
    it saves an open/close pair per file per tick, about half the sampler's cost."""

    def __init__(self, keep_open: bool) -> None:
        self._fds: dict[str, int] = {}
        self.keep_open = keep_open   # only for procfs: a regular file (a fixture) is read afresh

    def read(self, path: str) -> str | None:
        if not self.keep_open:
            return _read(path)
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return None
            self._fds[path] = fd
        try:
            chunks = []
            off = 0
            while True:
                b = os.pread(fd, 65536, off)
                chunks.append(b)
                if len(b) < 65536:
                    break
                off += len(b)
        except OSError:      # e.g. the file went away (fixture swapped): reopen next time
            self._close(path)
            return None
        return decode(b"".join(chunks))

    def _close(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        for path in list(self._fds):
            self._close(path)


def cpu_percents(prev: list[int], cur: list[int]) -> dict[str, float] | None:
    """user/system/iowait/steal/idle shares (0-100) between two /proc/stat cpu lines.

    user includes nice (guest time is already inside user); system includes irq and softirq.
    """
    d = [max(0, c - p) for c, p in zip(cur, prev)]   # a CPU going offline/online can reset counters
    d += [0] * (8 - len(d))
    total = sum(d[:8])
    if total <= 0:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = d[:8]
    k = 100.0 / total
    return {"cpu_user_percent": (user + nice) * k, "cpu_system_percent": (system + irq + softirq) * k,
            "cpu_iowait_percent": iowait * k, "cpu_steal_percent": steal * k, "cpu_idle_percent": idle * k}


def parse_psi(text: str, on_bad=None) -> dict[str, dict[str, float]]:
    """{'some': {'avg10': .., 'total': ..}, 'full': {...}} from a /proc/pressure/* file. A malformed line
    is skipped (and passed to ``on_bad(line, exc)`` when given); without ``on_bad`` it raises."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        try:
            out[parts[0]] = {k: float(v) for k, _, v in (p.partition("=") for p in parts[1:])}
        except ValueError as exc:
            if on_bad is None:
                raise
            on_bad(line, exc)
    return out


def numa_layout(sys_root: str = "/sys") -> dict[int, dict[str, Any]]:
    """{node: {'cpus': '0-15', 'mem_total_bytes': int}} from sysfs; {} when not exposed."""
    base = Path(sys_root) / "devices/system/node"
    out: dict[int, dict[str, Any]] = {}
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return out
    for d in entries:
        m = re.fullmatch(r"node(\d+)", d.name)
        if not m:
            continue
        cpus = (_read(str(d / "cpulist")) or "").strip()
        mem = 0
        for line in (_read(str(d / "meminfo")) or "").splitlines():
            if "MemTotal:" in line:
                mem = int(line.split()[-2]) * 1024
        out[int(m.group(1))] = {"cpus": cpus, "mem_total_bytes": mem}
    return out


class HostSampler:
    """Sampler (agent/samplers/sampling.py) for host-level telemetry."""

    name = "host"

    def __init__(self, proc_root: str = "/proc", sys_root: str = "/sys", per_cpu: bool = True,
                 skip_nics: str = r"^lo$") -> None:
        self.proc = proc_root.rstrip("/")
        self.sys = sys_root.rstrip("/")
        self.per_cpu = per_cpu
        self._skip_nic = re.compile(skip_nics) if skip_nics else None
        self._prev_t: float | None = None
        self._prev_cpu: dict[str, list[int]] = {}
        self._prev_ctxt: int | None = None
        self._prev_intr: int | None = None
        self._prev_disk: dict[str, list[int]] = {}
        self._prev_net: dict[str, list[int]] = {}
        self._prev_tcp: tuple[int, int] | None = None
        self._prev_psi: dict[str, float] = {}
        self._disk_ok: dict[str, bool] = {}
        self._psi_files = [r for r in ("cpu", "io", "memory") if os.path.exists(f"{self.proc}/pressure/{r}")]
        self.last: dict[str, float] = {}   # latest node-wide values, for `gpuagent status`
        self._files = _ProcFiles(keep_open=os.path.realpath(self.proc) == "/proc")
        self._read = self._files.read
        self.guard = SourceGuard("host")

    def sample(self, ts_ns: int, sink) -> None:
        t = ts_ns / 1e9
        dt = (t - self._prev_t) if self._prev_t is not None else None
        if dt is not None and dt <= 0:
            dt = None
        self._prev_t = t
        add = sink.add
        last = self.last

        def put(metric: str, v: float, labels=None) -> None:
            add(metric, v, labels=labels, ts_ns=ts_ns)
            if labels is None:
                last[metric] = v

        run = self.guard.run
        run("stat", self._stat, put, dt)
        run("loadavg", self._loadavg, put)
        run("meminfo", self._meminfo, put)
        rate_put, rate_dt = (put, dt) if dt is not None else (None, 0.0)
        run("disks", self._disks, rate_put, rate_dt)
        run("net", self._net, rate_put, rate_dt)
        run("tcp", self._tcp, rate_put, rate_dt)
        run("psi", self._psi, put, dt)

    @property
    def bad_lines(self) -> dict[str, int]:
        return self.guard.bad_lines

    @property
    def unavailable(self) -> list[str]:
        """Status notes (the daemon lists them with `gpuagent status`): sources that skipped lines or raised."""
        return self.guard.notes()

    # ------------------------------------------------------------------ sources
    def _stat(self, put, dt: float | None) -> None:
        text = self._read(f"{self.proc}/stat")
        if text is None:
            return
        for line in text.splitlines():
            try:
                self._stat_line(line, put, dt)
            except (ValueError, IndexError) as exc:
                self.guard.bad_line("stat", f"{self.proc}/stat", line, exc)

    def _stat_line(self, line: str, put, dt: float | None) -> None:
        if line.startswith("cpu"):
            name, _, rest = line.partition(" ")
            if name != "cpu" and not self.per_cpu:
                return
            cur = [int(x) for x in rest.split()[:8]]
            if len(cur) < 4:
                raise ValueError(f"{len(cur)} fields, at least 4 expected")
            prev = self._prev_cpu.get(name)
            self._prev_cpu[name] = cur
            if prev is None:
                return
            shares = cpu_percents(prev, cur)
            if shares is None:
                return
            labels = None if name == "cpu" else {"cpu": name[3:]}
            for metric, v in shares.items():
                put(metric, v, labels)
        elif line.startswith("ctxt "):
            v = int(line[5:])
            if self._prev_ctxt is not None and dt:
                put("context_switches_per_s", max(0, v - self._prev_ctxt) / dt)
            self._prev_ctxt = v
        elif line.startswith("intr "):
            v = int(line[5:].split(" ", 1)[0])
            if self._prev_intr is not None and dt:
                put("interrupts_per_s", max(0, v - self._prev_intr) / dt)
            self._prev_intr = v

    def _loadavg(self, put) -> None:
        text = self._read(f"{self.proc}/loadavg")
        if text:
            try:
                a = [float(x) for x in text.split()[:3]]
                if len(a) < 3:
                    raise ValueError(f"{len(a)} load averages, 3 expected")
            except ValueError as exc:
                self.guard.bad_line("loadavg", f"{self.proc}/loadavg", text.strip(), exc)
                return
            put("load1", a[0])
            put("load5", a[1])
            put("load15", a[2])

    def _meminfo(self, put) -> None:
        text = self._read(f"{self.proc}/meminfo")
        if text is None:
            return
        kv: dict[str, int] = {}
        for line in text.splitlines():
            k, _, rest = line.partition(":")
            if k in ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SReclaimable",
                     "SwapTotal", "SwapFree"):
                try:
                    kv[k] = int(rest.split()[0]) * 1024
                except (ValueError, IndexError) as exc:
                    self.guard.bad_line("meminfo", f"{self.proc}/meminfo", line, exc)
        if "MemTotal" not in kv:
            return
        total = kv["MemTotal"]
        avail = kv.get("MemAvailable")
        if avail is None:  # kernels before 3.14
            avail = kv.get("MemFree", 0) + kv.get("Buffers", 0) + kv.get("Cached", 0)
        put("mem_total_bytes", total)
        put("mem_available_bytes", avail)
        put("mem_used_bytes", max(0, total - avail))
        put("swap_used_bytes", max(0, kv.get("SwapTotal", 0) - kv.get("SwapFree", 0)))

    def _is_disk(self, name: str) -> bool:
        ok = self._disk_ok.get(name)
        if ok is None:
            if _SKIP_DISK.match(name):
                ok = False
            elif os.path.isdir(f"{self.sys}/block"):
                ok = os.path.exists(f"{self.sys}/block/{name.replace('/', '!')}")  # whole disks only
            else:
                ok = not re.search(r"(\d+p\d+|[a-z]d[a-z]+\d+|vd[a-z]+\d+)$", name)
            self._disk_ok[name] = ok
        return ok

    def _disks(self, put, dt: float) -> None:
        text = self._read(f"{self.proc}/diskstats")
        if text is None:
            return
        seen = {}
        for line in text.splitlines():
            a = line.split()
            if not a:
                continue
            try:
                if len(a) < 14:
                    raise ValueError(f"{len(a)} fields, at least 14 expected")
                if not self._is_disk(a[2]):
                    continue
                # reads, sectors read, ms reading, writes, sectors written, ms writing, ms doing I/O
                cur = [int(a[3]), int(a[5]), int(a[6]), int(a[7]), int(a[9]), int(a[10]), int(a[12])]
            except ValueError as exc:
                self.guard.bad_line("disks", f"{self.proc}/diskstats", line, exc)
                continue
            name = a[2]
            seen[name] = cur
            prev = self._prev_disk.get(name)
            if put is None or prev is None:
                continue
            d = [max(0, c - p) for c, p in zip(cur, prev)]
            lab = {"device": name}
            put("disk_read_bytes_per_s", d[1] * 512 / dt, lab)
            put("disk_write_bytes_per_s", d[4] * 512 / dt, lab)
            put("disk_read_iops", d[0] / dt, lab)
            put("disk_write_iops", d[3] / dt, lab)
            put("disk_read_latency_ms", d[2] / d[0] if d[0] else 0.0, lab)
            put("disk_write_latency_ms", d[5] / d[3] if d[3] else 0.0, lab)
            put("disk_busy_percent", min(100.0, d[6] / (dt * 10.0)), lab)
        self._prev_disk = seen

    def _net(self, put, dt: float) -> None:
        text = self._read(f"{self.proc}/net/dev")
        if text is None:
            return
        seen = {}
        for line in text.splitlines()[2:]:
            # The counters never hold a colon, so the name is everything before the last one: an alias
            # such as "ibr10:30" keeps its whole name (the kernel pads names to 6 and may give no space
            # between the colon and a large rx byte count).
            if not line.strip():
                continue
            name, colon, rest = line.rpartition(":")
            name = name.strip()
            if name and self._skip_nic and self._skip_nic.search(name):
                continue
            try:
                if not colon or not name:
                    raise ValueError("no 'name:' prefix")
                a = rest.split()
                if len(a) < 16:
                    raise ValueError(f"{len(a)} counters, 16 expected")
                # rx bytes, rx errs, rx drop, tx bytes, tx errs, tx drop
                cur = [int(a[0]), int(a[2]), int(a[3]), int(a[8]), int(a[10]), int(a[11])]
            except ValueError as exc:
                self.guard.bad_line("net", f"{self.proc}/net/dev", line, exc)
                continue
            seen[name] = cur
            prev = self._prev_net.get(name)
            if put is None or prev is None:
                continue
            d = [max(0, c - p) for c, p in zip(cur, prev)]
            lab = {"nic": name}
            put("net_rx_bytes_per_s", d[0] / dt, lab)
            put("net_tx_bytes_per_s", d[3] / dt, lab)
            put("net_rx_errors_per_s", d[1] / dt, lab)
            put("net_tx_errors_per_s", d[4] / dt, lab)
            put("net_rx_drops_per_s", d[2] / dt, lab)
            put("net_tx_drops_per_s", d[5] / dt, lab)
        self._prev_net = seen

    def _tcp(self, put, dt: float) -> None:
        """Node-wide TCP retransmits (/proc/net/snmp): the evidence that a slow link loses packets."""
        text = self._read(f"{self.proc}/net/snmp")
        if text is None:
            return
        rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
        if len(rows) < 2:
            return
        tcp = dict(zip(rows[0], rows[1]))
        try:
            cur = (int(tcp["OutSegs"]), int(tcp["RetransSegs"]))
        except (KeyError, ValueError) as exc:
            self.guard.bad_line("tcp", f"{self.proc}/net/snmp", " ".join(rows[1]), exc)
            return
        prev, self._prev_tcp = self._prev_tcp, cur
        if put is None or prev is None:
            return
        out_segs, retrans = (max(0, c - p) for c, p in zip(cur, prev))
        put("net_tcp_out_segs_per_s", out_segs / dt)
        put("net_tcp_retrans_segs_per_s", retrans / dt)
        put("net_tcp_retrans_percent", 100.0 * retrans / out_segs if out_segs else 0.0)

    def _psi(self, put, dt: float | None) -> None:
        for res in self._psi_files:
            path = f"{self.proc}/pressure/{res}"
            text = self._read(path)
            if not text:
                continue
            psi = parse_psi(text, on_bad=lambda line, exc, p=path: self.guard.bad_line("psi", p, line, exc))
            for kind in ("some", "full"):
                row = psi.get(kind)
                if row is None or (res == "cpu" and kind == "full"):
                    continue   # cpu "full" is always 0 outside cgroups (kernel docs); not a metric
                put(f"psi_{res}_{kind}_avg10_percent", row.get("avg10", 0.0))
                if kind == "some" and "total" in row:
                    key = f"{res}_{kind}"
                    prev = self._prev_psi.get(key)
                    self._prev_psi[key] = row["total"]
                    if prev is not None and dt:
                        # total is cumulative stall time in microseconds
                        put(f"psi_{res}_some_stall_percent",
                            min(100.0, max(0.0, row["total"] - prev) / (dt * 1e6) * 100.0))

    def close(self) -> None:
        self._files.close()
