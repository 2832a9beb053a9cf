"""The /proc/<pid> reads of job discovery (agent/samplers/job_discovery.py): a process's stat, environment,
memory and I/O counters, its start time on the wall clock, and its CPU, RSS and I/O rates since the last
tick. One reader of each file, shared by the scan that decides what a process is (JobDiscovery._proc_for),
the Slurm lookups (job_naming.py) and the neighbour series (job_contention.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuagent.agent.config import JobRules

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_ENV_WANTED = ("GPUAGENT_JOB_ID", "GPUAGENT_JOB_NAME", "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_ARRAY_JOB_ID",
               "SLURM_ARRAY_TASK_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID",
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "HOSTNAME")


@dataclass
class _Proc:
    start: int
    ident: dict[str, Any] | None            # None: not a job process
    prev_t: float | None = None
    prev_cpu: int = 0
    prev_io: tuple[int, int] | None = None
    stat: tuple[int, int, int] | None = None   # the latest /proc/<pid>/stat read (reused within a tick)
    adopted: dict[str, Any] | None = None      # a launcher's identity taken from the workers it started
    recheck_ns: int = 0                        # monotonic time of the one re-identification (0: done)


class JobProcfsMixin:
    """JobDiscovery's /proc readers (agent/samplers/job_discovery.py)."""

    proc: str
    rules: JobRules

    def _start_wall_ns(self, p: _Proc | None) -> int | None:
        """A process's start as wall-clock ns: /proc/<pid>/stat starttime counts clock ticks on the boot
        clock (CLOCK_BOOTTIME), so wall = now - boot clock now + starttime. None when unknown."""
        return None if p is None else self._start_ticks_wall_ns(p.start)

    def _start_ticks_wall_ns(self, start_ticks: int) -> int | None:
        """/proc/<pid>/stat starttime (clock ticks on the boot clock) as wall-clock ns; None when unknown."""
        if self._boot_wall_ns is None:
            return None
        return self._boot_wall_ns() + start_ticks * 1_000_000_000 // _CLK_TCK

    def _boot_wall_clock(self) -> Callable[[], int] | None:
        """Wall-clock ns of boot: from the live boot clock for the real /proc; from ``btime`` (whole
        seconds) of <proc_root>/stat for another procfs; None when neither is available."""
        if self.proc == "/proc" and hasattr(time, "CLOCK_BOOTTIME"):
            return lambda: time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        try:
            with open(f"{self.proc}/stat", "rb") as f:
                for line in f:
                    if line.startswith(b"btime "):
                        btime_ns = int(line.split()[1]) * 1_000_000_000
                        return lambda: btime_ns
        except (OSError, ValueError, IndexError):
            pass
        return None

    def _stat(self, pid: int) -> tuple[int, int, int] | None:
        """(utime+stime ticks, start time ticks, parent pid) or None when the process is gone."""
        try:
            with open(f"{self.proc}/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            return None
        rest = raw[raw.rfind(b")") + 2:].split()
        if rest[:1] == [b"Z"]:   # a zombie has exited; only its parent has not reaped it yet
            return None
        try:
            return int(rest[11]) + int(rest[12]), int(rest[19]), int(rest[1])
        except (IndexError, ValueError):
            return None

    def _read_bytes(self, pid: int, name: str) -> bytes | None:
        try:
            with open(f"{self.proc}/{pid}/{name}", "rb") as f:
                return f.read()
        except OSError:
            return None

    def _environ(self, pid: int) -> dict[str, str]:
        raw = self._read_bytes(pid, "environ") or b""
        out = {}
        for item in raw.split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                key = k.decode("utf-8", "replace")
                if key in _ENV_WANTED or key in self.rules.env_keys:
                    out[key] = v.decode("utf-8", "replace")
        return out

    def _rss(self, pid: int) -> float:
        raw = self._read_bytes(pid, "statm")
        try:
            return float(int(raw.split()[1]) * _PAGE) if raw else 0.0
        except (IndexError, ValueError):
            return 0.0

    def _io(self, pid: int) -> tuple[int, int] | None:
        raw = self._read_bytes(pid, "io")   # needs same uid or CAP_SYS_PTRACE; None otherwise
        if not raw:
            return None
        r = w = 0
        for line in raw.split(b"\n"):
            if line.startswith(b"read_bytes:"):
                r = int(line.split()[1])
            elif line.startswith(b"write_bytes:"):
                w = int(line.split()[1])
        return r, w

    def _usage(self, pid: int, p: _Proc | None, t: float) -> tuple[float, float, float, float]:
        if p is None:
            return 0.0, 0.0, 0.0, 0.0
        st = p.stat
        if st is None:
            return 0.0, 0.0, 0.0, 0.0
        io = self._io(pid)
        cpu = rd = wr = 0.0
        if p.prev_t is not None and t > p.prev_t:
            dt = t - p.prev_t
            cpu = max(0, st[0] - p.prev_cpu) / _CLK_TCK / dt * 100.0
            if io is not None and p.prev_io is not None:
                rd = max(0, io[0] - p.prev_io[0]) / dt
                wr = max(0, io[1] - p.prev_io[1]) / dt
        p.prev_t, p.prev_cpu, p.prev_io = t, st[0], io
        return cpu, self._rss(pid), rd, wr
